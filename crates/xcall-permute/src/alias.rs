//! Alias tables and the overlap check every call runs before writing.
