//! Criterion benchmarks of xcall live in `benches/`; this library is empty.
