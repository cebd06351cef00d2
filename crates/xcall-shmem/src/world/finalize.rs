//! Finalize, step by step (see the module docs of [`super`]).

use super::config::FinalizeReport;
use super::live::{Live, PeerMap};
use super::state::{finalize_step, FinalizeStep, FINALIZE_FAILED};
use crate::error::{Result, ShmemError};

impl Live {
    pub(super) fn finalize(mut self) -> Result<FinalizeReport> {
        if let Err(e) = self.state.check() {
            // The collective steps would wait for a PE that is gone.
            return Err(e.context(format!("finalize of rank {} (released locally)", self.rank)));
        }
        let mut first: Option<ShmemError> = None;
        let mut keep = |r: Result<()>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        keep(self.quiet());
        keep(self.collective("finalize", 0));
        let leaked: Vec<(usize, usize)> = self
            .alloc
            .live()
            .into_iter()
            .filter(|&(o, _)| o != 0)
            .collect();
        for &(o, _) in &leaked {
            keep(self.alloc.free(o).map(|_| ()));
        }
        if let Some(comm) = self.nccl.take() {
            let state = &self.state;
            keep(comm.finalize(self.timeout, &|| state.check()));
        }
        // Close other processes' heaps and let go of same-process ones.
        for p in &mut self.peers {
            p.map = PeerMap::Released;
        }
        finalize_step(self.rank, FinalizeStep::PeersReleased);
        // No PE releases its heap before every peer let go of it.
        keep(self.boot.barrier());
        drop(self.stream.take());
        if first.is_some() {
            // A peer may not have arrived: it must not touch this heap.
            self.state.fail(FINALIZE_FAILED, self.rank);
        }
        finalize_step(self.rank, FinalizeStep::HeapReleasing);
        let Live {
            boot,
            memory,
            _binding,
            ..
        } = self;
        drop(memory);
        drop(_binding);
        drop(boot);
        match first {
            Some(e) => Err(e.context("finalize")),
            None => Ok(FinalizeReport { leaked }),
        }
    }

    /// Refuses finalize, changing nothing, while CUDA graphs that captured
    /// this PE's NCCL transfers are alive: NCCL would not finish (nor
    /// abort) the communicator before they are destroyed.
    pub(super) fn no_graphs_hold_nccl(&self) -> Result<()> {
        let Some(comm) = &self.nccl else {
            return Ok(());
        };
        let alive = comm.graphs_alive(self.timeout);
        if alive == 0 {
            return Ok(());
        }
        Err(ShmemError::State(format!(
            "finalize of rank {}: {alive} CUDA graph(s) that captured this world's NCCL transfers are alive, and NCCL does not finish a communicator before they are destroyed: destroy them (and their executable graphs), then finalize again; the world stays live",
            self.rank
        )))
    }
}
