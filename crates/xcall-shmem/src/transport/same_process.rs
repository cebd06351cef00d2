//! Handing objects to the PEs of this process during init.
//!
//! PEs in one process address each other's heaps directly, so a heap must
//! stay mapped for as long as any PE of the process can reach it, not only
//! as long as its owner lives. The owner offers its heap (an `Arc`) under a
//! token, sends the token through the bootstrap, and every same-process
//! peer takes a clone: the memory goes when the last PE holding it lets go.
//! The same carries a world's shared state page.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

type Slots = Mutex<HashMap<u64, Arc<dyn Any + Send + Sync>>>;

fn slots() -> &'static Slots {
    static SLOTS: OnceLock<Slots> = OnceLock::new();
    SLOTS.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<u64, Arc<dyn Any + Send + Sync>>> {
    // Plain data: valid after any interrupted update.
    slots().lock().unwrap_or_else(|p| p.into_inner())
}

/// An object on offer; withdrawn when dropped (init done, or failed).
pub(crate) struct Offer {
    pub token: u64,
}

/// Offers `value` to the PEs of this process under a fresh token.
pub(crate) fn offer<T: Any + Send + Sync>(value: Arc<T>) -> Offer {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    lock().insert(token, value);
    Offer { token }
}

/// A clone of the object offered under `token`, if it is on offer and a `T`.
pub(crate) fn take<T: Any + Send + Sync>(token: u64) -> Option<Arc<T>> {
    let v = lock().get(&token)?.clone();
    v.downcast::<T>().ok()
}

impl Drop for Offer {
    fn drop(&mut self) {
        lock().remove(&self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_is_taken_by_token_and_type_until_withdrawn() {
        let o = offer(Arc::new(41u32));
        assert_eq!(take::<u32>(o.token).as_deref(), Some(&41));
        assert!(take::<u64>(o.token).is_none(), "wrong type");
        let token = o.token;
        drop(o);
        assert!(take::<u32>(token).is_none(), "withdrawn");
    }
}
