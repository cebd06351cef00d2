//! The world's state page (how a PE learns that a peer failed) and the
//! finalize hook tests observe.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::agreement::{agree, fields};
use super::config::WorldConfig;
use crate::bootstrap::Bootstrap;
use crate::error::{Result, ShmemError};
use crate::transport::host_shared_memory::{HostHeap, HostMapping};
use crate::transport::same_process::{self as handoff, Offer};

/// Bytes of a world's state page.
const STATE_PAGE: usize = 4096;

/// A step of [`World::finalize`] a test may observe
/// ([`set_finalize_hook`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizeStep {
    /// This PE let go of its mappings of every peer's heap.
    PeersReleased,
    /// This PE is about to release its own heap.
    HeapReleasing,
}

/// A finalize hook: `hook(rank, step)`.
#[doc(hidden)]
pub type FinalizeHook = fn(usize, FinalizeStep);

thread_local! {
    static FINALIZE_HOOK: std::cell::Cell<Option<FinalizeHook>> = const { std::cell::Cell::new(None) };
}

/// Test hook: `hook(rank, step)` runs on this thread at each
/// [`FinalizeStep`] of a finalize it calls (`None` removes it). Tests use
/// it to check that no PE releases its heap before every peer released
/// its mappings of it.
#[doc(hidden)]
pub fn set_finalize_hook(hook: Option<FinalizeHook>) {
    FINALIZE_HOOK.with(|h| h.set(hook));
}

pub(super) fn finalize_step(rank: usize, step: FinalizeStep) {
    if let Some(hook) = FINALIZE_HOOK.with(|h| h.get()) {
        hook(rank, step);
    }
}

/// Why a world failed, in its state word: `reason << 32 | (rank + 1)`.
pub(super) const LEFT_WITHOUT_FINALIZE: u64 = 1;
pub(super) const FINALIZE_FAILED: u64 = 2;
pub(super) const NCCL_FAILED: u64 = 3;
pub(super) const EXCHANGE_TIMED_OUT: u64 = 4;

/// The world's state page: host memory every PE of the world maps (its
/// first word is 0 while the world is healthy).
pub(super) enum StatePage {
    SameProcess(Arc<HostHeap>),
    Mapped(HostMapping),
}

impl StatePage {
    pub(super) fn word(&self) -> &AtomicU64 {
        let base = match self {
            StatePage::SameProcess(h) => h.base,
            StatePage::Mapped(m) => m.base,
        };
        // SAFETY: the first 8 bytes of a page-aligned mapping this PE holds
        // for as long as `self` lives; every access is atomic.
        unsafe { &*(base as *const AtomicU64) }
    }

    pub(super) fn fail(&self, reason: u64, rank: usize) {
        let code = (reason << 32) | (rank as u64 + 1);
        // The first failure is the one reported.
        let _ = self
            .word()
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(super) fn check(&self) -> Result<()> {
        let code = self.word().load(Ordering::Acquire);
        if code == 0 {
            return Ok(());
        }
        let rank = (code & 0xffff_ffff).saturating_sub(1);
        let why = match code >> 32 {
            LEFT_WITHOUT_FINALIZE => "left the world without finalize",
            FINALIZE_FAILED => "failed in finalize",
            NCCL_FAILED => "saw its NCCL transfers fail",
            EXCHANGE_TIMED_OUT => "timed out in an exchange on its stream",
            _ => "failed",
        };
        Err(ShmemError::PeerFailed(format!(
            "rank {rank} {why}; nothing more crosses this world, only finalize remains"
        )))
    }
}

/// The lowest rank of each host (`leader`) makes the state page of its
/// host's PEs (shared memory when some PE of the host is in another
/// process, `cross`); every PE maps its host's: same-process PEs by a
/// handoff, others by name. Returns the page and, on a leader, its offer
/// (withdrawn once every PE mapped it). PEs on other hosts learn of a
/// failure through NCCL's errors or the world's timeout.
pub(super) fn state_page(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    leader: usize,
    cross: bool,
    same_process: &dyn Fn(usize) -> bool,
) -> Result<(StatePage, Option<Offer>)> {
    let made = if c.rank == leader {
        let name = format!("/xcall-state-{}-{}", std::process::id(), unique());
        let page = if cross {
            HostHeap::shared(&name, STATE_PAGE)
        } else {
            HostHeap::private(STATE_PAGE)
        };
        page.map(|p| {
            let p = Arc::new(p);
            (p.clone(), handoff::offer(p), name)
        })
    } else {
        Err(ShmemError::State("not a leader".into()))
    };
    let (announce, local) = match made {
        Ok((page, offer, name)) => (Ok(format!("{}\n{name}", offer.token)), Some((page, offer))),
        Err(e) if c.rank == leader => (Err(e), None),
        Err(_) => (Ok(String::new()), None),
    };
    let announce = agree(boot, announce)?;
    let announced = boot.allgather(announce.as_bytes())?;
    let from_leader = fields(&announced[leader]);
    let mapped = match local {
        Some((page, offer)) => Ok((StatePage::SameProcess(page), Some(offer))),
        None if same_process(leader) => from_leader
            .first()
            .and_then(|t| t.parse().ok())
            .and_then(handoff::take::<HostHeap>)
            .map(|p| (StatePage::SameProcess(p), None))
            .ok_or_else(|| {
                ShmemError::Mismatch(format!(
                    "rank {leader}'s state page is not on offer in this process"
                ))
            }),
        None => match from_leader.get(1) {
            Some(name) => HostMapping::open(name, STATE_PAGE).map(|m| (StatePage::Mapped(m), None)),
            None => Err(ShmemError::Mismatch(format!(
                "rank {leader} sent a malformed state page name"
            ))),
        },
    };
    agree(boot, mapped)
}

pub(super) fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
