//! The live handles of the C ABI.
//!
//! Every opaque handle xcall hands out (`xcall_graph_cache`,
//! `xcall_ws_plan`, `xcall_shmem_world`) is recorded here, with its type,
//! from its `_new` until its `_free`. Every entry point looks its handle up
//! before touching it, so a handle that was freed already, one xcall never
//! made, or one of another type gets `XCALL_STATUS_INVALID_HANDLE` instead
//! of a use after free, and a second `_free` does nothing.
//!
//! Limits (documented in the header): the check is by address, so a freed
//! handle whose address the allocator has given to a new handle of the same
//! type names the new one; and a `_free` that runs while another thread is
//! inside a call on the same handle is still the caller's race.
//!
//! The table is read on every call (a read lock: calls on different or the
//! same handles never wait for each other) and written only by `_new` and
//! `_free`.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use xcall_core::Status;

use crate::guard::FfiError;

/// A type handed to C as an opaque handle.
pub(crate) trait Handle: Sized + Send + 'static {
    /// Its C name, for messages.
    const TYPE: &'static str;
}

#[derive(Clone, Copy)]
struct Entry {
    type_name: &'static str,
    /// Owned by the library (never freed by `_free`).
    library_owned: bool,
}

fn table() -> &'static RwLock<HashMap<usize, Entry>> {
    static TABLE: OnceLock<RwLock<HashMap<usize, Entry>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

// The table holds plain data, valid after any interrupted update: a panic
// elsewhere must not make every later call fail.
fn read() -> RwLockReadGuard<'static, HashMap<usize, Entry>> {
    table().read().unwrap_or_else(|p| p.into_inner())
}

fn write() -> RwLockWriteGuard<'static, HashMap<usize, Entry>> {
    table().write().unwrap_or_else(|p| p.into_inner())
}

/// Hands `value` out as a handle, recorded as live.
pub(crate) fn publish<T: Handle>(value: T) -> Result<*mut T, FfiError> {
    let mut t = write();
    t.try_reserve(1).map_err(|_| {
        FfiError::new(
            Status::OutOfMemory,
            format!("no memory to record a new {}", T::TYPE),
        )
    })?;
    let p = Box::into_raw(Box::new(value));
    t.insert(
        p as usize,
        Entry {
            type_name: T::TYPE,
            library_owned: false,
        },
    );
    Ok(p)
}

/// Records a handle the library owns for the whole process (never freed).
pub(crate) fn publish_static<T: Handle>(value: &'static T) {
    write().insert(
        value as *const T as usize,
        Entry {
            type_name: T::TYPE,
            library_owned: true,
        },
    );
}

fn check<T: Handle>(p: *const T, arg: &str, t: &HashMap<usize, Entry>) -> Result<Entry, FfiError> {
    if p.is_null() {
        return Err(FfiError::new(
            Status::NullArgument,
            format!("{arg} is NULL"),
        ));
    }
    match t.get(&(p as usize)) {
        Some(e) if e.type_name == T::TYPE => Ok(*e),
        Some(e) => Err(FfiError::new(
            Status::InvalidHandle,
            format!("{arg} ({p:p}) is an {}, not an {}", e.type_name, T::TYPE),
        )),
        None => Err(FfiError::new(
            Status::InvalidHandle,
            format!(
                "{arg} ({p:p}) is not a live {}: freed already, or not made by xcall",
                T::TYPE
            ),
        )),
    }
}

/// The handle behind `p`: NULL is `NullArgument`, anything not live of type
/// `T` is `InvalidHandle`, both naming `arg`.
pub(crate) fn get<'a, T: Handle>(p: *const T, arg: &str) -> Result<&'a T, FfiError> {
    check(p, arg, &read())?;
    // SAFETY: `p` is recorded live with type T: it came from `publish` (a
    // Box not yet released) or `publish_static`. A concurrent `_free` of the
    // same handle is the caller's race, as the header says.
    Ok(unsafe { &*p })
}

/// Takes a handle back for `_free`: `Ok(None)` for NULL and for a
/// library-owned handle (both no-ops), `InvalidHandle` for anything not
/// live. The handle is no longer live afterwards.
pub(crate) fn release<T: Handle>(p: *mut T, arg: &str) -> Result<Option<Box<T>>, FfiError> {
    if p.is_null() {
        return Ok(None);
    }
    let mut t = write();
    if check(p, arg, &t)?.library_owned {
        return Ok(None);
    }
    t.remove(&(p as usize));
    drop(t);
    // SAFETY: `p` came from `publish` (Box::into_raw) and was live until the
    // removal above, which makes this the only release.
    Ok(Some(unsafe { Box::from_raw(p) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct A(#[allow(dead_code)] u64);
    impl Handle for A {
        const TYPE: &'static str = "test_a";
    }
    struct B(#[allow(dead_code)] u64);
    impl Handle for B {
        const TYPE: &'static str = "test_b";
    }

    #[test]
    fn live_handles_resolve_and_freed_ones_do_not() {
        let a = publish(A(7)).unwrap();
        assert!(get(a, "a").is_ok());
        let freed = release(a, "a").unwrap();
        assert!(freed.is_some());
        let e = get(a as *const A, "a").err().unwrap();
        assert_eq!(e.status, Status::InvalidHandle);
        assert!(e.message.contains("a (0x"), "{}", e.message);
        assert!(e.message.contains("not a live test_a"), "{}", e.message);
        // A second free is refused, not a double free.
        let e = release(a, "a").err().unwrap();
        assert_eq!(e.status, Status::InvalidHandle);
    }

    #[test]
    fn a_handle_of_another_type_is_refused() {
        let b = publish(B(1)).unwrap();
        let e = get(b as *const A, "plan").err().unwrap();
        assert_eq!(e.status, Status::InvalidHandle);
        assert!(
            e.message.contains("is an test_b, not an test_a"),
            "{}",
            e.message
        );
        assert_eq!(
            release(b as *mut A, "plan").err().unwrap().status,
            Status::InvalidHandle
        );
        assert!(release(b, "b").unwrap().is_some());
    }

    #[test]
    fn null_and_foreign_pointers() {
        assert_eq!(
            get(std::ptr::null::<A>(), "w").err().unwrap().status,
            Status::NullArgument
        );
        assert!(release(std::ptr::null_mut::<A>(), "w").unwrap().is_none());
        let local = A(3);
        assert_eq!(
            get(&local as *const A, "w").err().unwrap().status,
            Status::InvalidHandle
        );
    }

    #[test]
    fn library_owned_handles_survive_free() {
        static OWNED: A = A(9);
        publish_static(&OWNED);
        let p = &OWNED as *const A as *mut A;
        assert!(release(p, "c").unwrap().is_none());
        assert!(get(p as *const A, "c").is_ok());
    }
}
