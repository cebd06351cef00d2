//! The symmetric heap and its first-fit allocator.
