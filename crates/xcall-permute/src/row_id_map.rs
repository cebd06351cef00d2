//! Routing map to row-id map, with token caps and expert padding.
