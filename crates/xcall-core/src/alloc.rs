//! Fallible allocation for buffers whose size comes from a caller.
//!
//! `vec![x; n]` aborts the process when `n` elements cannot be had; inside
//! someone else's process (a framework, an XLA runtime) that takes the
//! whole job down. Every buffer sized by input goes through [`try_vec`]
//! instead, after the input was validated, and a size that cannot be met
//! is an [`Error::OutOfMemory`] naming the buffer.

use crate::{Error, Result};

/// `len` copies of `value`, or [`Error::OutOfMemory`] naming `what` when
/// the bytes overflow or cannot be allocated.
pub fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::OutOfMemory(format!(
            "{what}: {len} elements of {} bytes cannot be allocated",
            std::mem::size_of::<T>()
        ))
    })?;
    v.resize(len, value);
    Ok(v)
}

/// The product of `factors`, or [`Error::InvalidArgument`] naming `what`
/// when it overflows `usize`.
pub fn checked_product(what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::InvalidArgument(format!("{what}: {factors:?} overflow a size")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let e = try_vec(usize::MAX / 2, 0f32, "scratch").unwrap_err();
        assert_eq!(e.status(), Status::OutOfMemory);
        assert!(e.to_string().contains("scratch"), "{e}");
        let e = try_vec(1usize << 50, 0u8, "huge").unwrap_err();
        assert_eq!(e.status(), Status::OutOfMemory);
        assert_eq!(try_vec(3, 7u16, "small").unwrap(), vec![7, 7, 7]);
    }

    #[test]
    fn products_are_checked() {
        assert_eq!(checked_product("x", &[3, 4, 5]).unwrap(), 60);
        assert_eq!(checked_product("x", &[]).unwrap(), 1);
        let e = checked_product("rows * hidden", &[1 << 40, 1 << 40]).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.to_string().contains("rows * hidden"), "{e}");
    }
}
