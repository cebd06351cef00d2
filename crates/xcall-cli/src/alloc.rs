//! The host buffers a command sizes from its flags, allocated fallibly: a
//! size this machine cannot give (or that no machine could) is an error
//! naming the buffer and its bytes, not an abort of the process.

use std::fmt;

/// A host buffer that could not be allocated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocError {
    /// What the buffer is for ("PE 0's tokens").
    pub what: String,
    /// Its size in bytes (exact: past `usize` too).
    pub bytes: u128,
    /// Why the allocation failed.
    pub cause: String,
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot allocate {} ({} bytes): {}",
            self.what, self.bytes, self.cause
        )
    }
}

impl std::error::Error for AllocError {}

/// Why a thread of a run stopped: a buffer it could not allocate (the
/// run reports that alone: what the other threads saw then follows from
/// it), or anything else, as a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunError {
    /// A host buffer could not be allocated.
    Alloc(AllocError),
    /// Anything else.
    Failed(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Alloc(e) => e.fmt(f),
            RunError::Failed(m) => f.write_str(m),
        }
    }
}

impl From<AllocError> for RunError {
    fn from(e: AllocError) -> RunError {
        RunError::Alloc(e)
    }
}

impl From<String> for RunError {
    fn from(m: String) -> RunError {
        RunError::Failed(m)
    }
}

impl From<&str> for RunError {
    fn from(m: &str) -> RunError {
        RunError::Failed(m.to_string())
    }
}

/// An empty vector with room for exactly `len` values of `T`, or an error
/// naming `what` (called only then, to build the name).
pub fn with_capacity<T>(what: impl FnOnce() -> String, len: usize) -> Result<Vec<T>, AllocError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| AllocError {
        what: what(),
        bytes: len as u128 * std::mem::size_of::<T>() as u128,
        cause: e.to_string(),
    })?;
    Ok(v)
}

/// `rows * cols`, the values of a `[rows, cols]` buffer of `T` named
/// `what`, or an error when that count passes the address space.
pub fn count<T>(
    what: impl FnOnce() -> String,
    rows: usize,
    cols: usize,
) -> Result<usize, AllocError> {
    rows.checked_mul(cols).ok_or_else(|| AllocError {
        what: what(),
        bytes: rows as u128 * cols as u128 * std::mem::size_of::<T>() as u128,
        cause: "more bytes than this machine can address".into(),
    })
}

/// Types whose value of all-zero bytes is their zero (0, 0.0, false).
///
/// # Safety
/// Every implementor must be valid with all its bytes zero.
pub unsafe trait Zeroed: Copy {}

// SAFETY: zero bytes are 0, 0.0 and false.
unsafe impl Zeroed for u8 {}
// SAFETY: as above.
unsafe impl Zeroed for bool {}
// SAFETY: as above.
unsafe impl Zeroed for f32 {}
// SAFETY: as above.
unsafe impl Zeroed for f64 {}
// SAFETY: as above.
unsafe impl Zeroed for usize {}

/// `len` zeros, or an error naming `what`. The memory comes zeroed from
/// the allocator (fresh pages of a large buffer are not written).
pub fn zeroed<T: Zeroed>(what: impl FnOnce() -> String, len: usize) -> Result<Vec<T>, AllocError> {
    let failed = |what: String, cause: &str| AllocError {
        what,
        bytes: len as u128 * std::mem::size_of::<T>() as u128,
        cause: cause.to_string(),
    };
    let Ok(layout) = std::alloc::Layout::array::<T>(len) else {
        return Err(failed(what(), "more bytes than an allocation may hold"));
    };
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout's size is above zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(failed(what(), "the memory allocator returned no memory"));
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of
    // `len` values of `T`, all of them zero bytes, which are valid `T`s
    // (`Zeroed`); the vector owns it from here.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// `len` copies of `value`, or an error naming `what`.
pub fn filled<T: Clone>(
    what: impl FnOnce() -> String,
    len: usize,
    value: T,
) -> Result<Vec<T>, AllocError> {
    let mut v = with_capacity(what, len)?;
    // Within the capacity reserved: no further allocation.
    v.resize(len, value);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_past_what_can_be_allocated_is_an_error_naming_the_buffer_and_its_bytes() {
        let e = filled(|| "the probs".into(), usize::MAX / 2, 0u32).unwrap_err();
        assert_eq!(e.what, "the probs");
        assert_eq!(e.bytes, (usize::MAX / 2) as u128 * 4);
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("cannot allocate the probs ({} bytes): ", e.bytes)),
            "{text}"
        );
        let v = filled(|| unreachable!("named only on failure"), 5, 7u8).unwrap();
        assert_eq!(v, [7; 5]);
        assert_eq!(v.capacity(), 5);
        let e = count::<f32>(|| "the probs".into(), usize::MAX, 3).unwrap_err();
        assert_eq!(e.bytes, usize::MAX as u128 * 12);
        assert_eq!(count::<f32>(|| unreachable!(), 6, 7), Ok(42));
        let e = zeroed::<f64>(|| "the output".into(), usize::MAX / 4).unwrap_err();
        assert_eq!(e.bytes, (usize::MAX / 4) as u128 * 8);
        assert!(
            e.to_string().starts_with("cannot allocate the output ("),
            "{e}"
        );
        let z: Vec<f32> = zeroed(|| unreachable!(), 1000).unwrap();
        assert_eq!((z.len(), z.capacity()), (1000, 1000));
        assert!(z.iter().all(|&v| v == 0.0));
        assert!(zeroed::<bool>(|| unreachable!(), 0).unwrap().is_empty());
        let v: Vec<u64> = with_capacity(|| unreachable!(), 3).unwrap();
        assert!(v.is_empty() && v.capacity() >= 3);
    }
}
