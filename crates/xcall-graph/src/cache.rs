//! The per-device graph cache: lookup, capture, replay, exec-update,
//! eviction.
//!
//! Locking: each device has its own shard and lock ([`DeviceMap`]); calls on
//! different devices never share a lock. A shard's lock is held for lookups,
//! launches and exec-updates (graph objects must not be used by two threads
//! at once), never while the caller's record function runs and never while
//! waiting for another thread. A key being captured is marked pending, so a
//! second thread with the same key runs eagerly instead of capturing again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use xcall_core::{Device, DeviceMap, Error, Platform};

use crate::backend::{GraphBackend, StreamState};
use crate::error::{GraphError, GraphResult};
use crate::key::{CallKey, Relocation};
use crate::policy::{CacheConfig, Policy};
use crate::shard::{Entry, Pending, Shard};

pub use crate::call::{Call, Outcome, Stats};

struct DeviceState<B: GraphBackend> {
    shard: Mutex<Shard<B>>,
    host_runs: AtomicU64,
}

/// A device-aware cache of captured CUDA graphs for custom calls.
///
/// Thread-safe: any method may be called from any thread. Calls on
/// different devices never contend; calls on one device serialise only for
/// lookups, launches and exec-updates, never for captures.
pub struct GraphCache<B: GraphBackend> {
    backend: B,
    config: CacheConfig,
    devices: DeviceMap<DeviceState<B>>,
}

#[derive(Clone, Copy, Debug)]
enum Eager {
    Disabled,
    CallerCapturing,
    CaptureInProgress,
    NotCapturable,
    CaptureFailed,
}

impl Eager {
    /// Why a call ran eagerly, as its log line says.
    fn reason(self) -> &'static str {
        match self {
            Eager::Disabled => "policy_disabled",
            Eager::CallerCapturing => "caller_capturing",
            Eager::CaptureInProgress => "capture_in_progress",
            Eager::NotCapturable => "not_capturable",
            Eager::CaptureFailed => "capture_failed",
        }
    }
}

/// What one call decided on the way to its outcome, gathered while the
/// device's lock is held and logged after it is released (a log callback
/// never runs under a cache lock).
#[derive(Default)]
struct Notes {
    eager: Option<Eager>,
    /// The step of a capture that failed.
    failed_at: Option<&'static str>,
    nodes: Option<usize>,
    /// Why a captured graph ran once and was not kept.
    not_cached: Option<&'static str>,
    evicted: usize,
    patch_refused: bool,
    update_refused: bool,
}

impl Notes {
    /// One line per call: `trace` for a replay or a Host run (hot paths),
    /// `debug` for every other decision.
    fn log(&self, key: &CallKey, outcome: Outcome) {
        let hot = matches!(outcome, Outcome::Replayed | Outcome::EagerHost);
        let level_on = if hot {
            tracing::enabled!(tracing::Level::TRACE)
        } else {
            tracing::enabled!(tracing::Level::DEBUG)
        };
        if !level_on {
            return;
        }
        let mut detail = String::new();
        let mut add = |name: &str, value: &dyn std::fmt::Display| {
            use std::fmt::Write as _;
            let _ = write!(detail, " {name}={value}");
        };
        if let Some(why) = self.eager {
            add("why", &why.reason());
        }
        if let Some(step) = self.failed_at {
            add("failed_at", &step);
        }
        if let Some(nodes) = self.nodes {
            add("nodes", &nodes);
        }
        if let Some(why) = self.not_cached {
            add("not_cached", &why);
        }
        if self.evicted > 0 {
            add("evicted", &self.evicted);
        }
        if self.patch_refused {
            add("patch_refused", &true);
        }
        if self.update_refused {
            add("update_refused", &true);
        }
        let (device, target_id) = (key.device, format_args!("{:#x}", key.target));
        let (attributes, buffers) = (
            format_args!("{:#x}", key.attributes.digest()),
            key.buffers.len(),
        );
        if hot {
            tracing::trace!(%device, %target_id, %attributes, buffers, "{}{detail}", outcome.name());
        } else {
            tracing::debug!(%device, %target_id, %attributes, buffers, "{}{detail}", outcome.name());
        }
    }
}

impl<B: GraphBackend> GraphCache<B> {
    /// A cache over `backend` with `config` (checked).
    pub fn new(backend: B, config: CacheConfig) -> Result<Self, Error> {
        config.validate()?;
        Ok(GraphCache {
            backend,
            config,
            devices: DeviceMap::new(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    fn state(&self, device: Device) -> &DeviceState<B> {
        self.devices.get_or_init(device, || DeviceState {
            shard: Mutex::new(Shard::new(self.config.bucket_mask)),
            host_runs: AtomicU64::new(0),
        })
    }

    fn lock(&self, device: Device) -> MutexGuard<'_, Shard<B>> {
        // A panic while holding the lock leaves the shard's maps consistent
        // (every mutation completes before anything that can fail), so a
        // poisoned lock is safe to keep using.
        self.state(device)
            .shard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a call: on Host, `record(None)` directly; on CUDA, replays the
    /// cached graph for the call's exact key, or captures `record(Some(stream))`
    /// into a graph (updating an executable of the same topology where the
    /// policy says so), or runs it eagerly when capture is not possible.
    ///
    /// Returns what happened. Bad input (no buffers, no stream on CUDA, a
    /// stream of another device) is refused before anything runs. When the
    /// record function fails during capture, the stream leaves capture mode,
    /// the function runs again eagerly and its result is returned.
    pub fn execute<E>(
        &self,
        call: &Call<B::Stream>,
        mut record: impl FnMut(Option<B::Stream>) -> Result<(), E>,
    ) -> GraphResult<Outcome>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        call.key.validate()?;
        let mut notes = Notes::default();
        let outcome = self.execute_noted(call, &mut record, &mut notes)?;
        notes.log(&call.key, outcome);
        Ok(outcome)
    }

    fn execute_noted<E>(
        &self,
        call: &Call<B::Stream>,
        record: &mut impl FnMut(Option<B::Stream>) -> Result<(), E>,
        notes: &mut Notes,
    ) -> GraphResult<Outcome>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let device = call.key.device;
        if device.platform == Platform::Host {
            if device != Device::HOST {
                return Err(Error::NoSuchDevice { device, count: 1 }.into());
            }
            record(None).map_err(|e| GraphError::Callback(e.into()))?;
            self.state(device).host_runs.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::EagerHost);
        }
        let stream = call
            .stream
            .ok_or_else(|| Error::InvalidArgument(format!("a call on {device} needs a stream")))?;
        let state = self.backend.stream_state(device, stream)?;
        // These run on the caller's stream as they are: no context switch,
        // which could disturb a capture the caller has open.
        if self.config.policy == Policy::Disabled {
            return self.eager(device, stream, Eager::Disabled, record, notes);
        }
        if state.capturing {
            return self.eager(device, stream, Eager::CallerCapturing, record, notes);
        }
        self.backend.with_context(device, &state, || {
            self.execute_on_stream(call, stream, state, record, notes)
        })?
    }

    fn eager<E>(
        &self,
        device: Device,
        stream: B::Stream,
        why: Eager,
        record: &mut impl FnMut(Option<B::Stream>) -> Result<(), E>,
        notes: &mut Notes,
    ) -> GraphResult<Outcome>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        notes.eager = Some(why);
        let result = record(Some(stream)).map_err(|e| GraphError::Callback(e.into()));
        let mut shard = self.lock(device);
        let counter = match why {
            Eager::Disabled => &mut shard.stats.eager_disabled,
            Eager::CallerCapturing => &mut shard.stats.eager_caller_capturing,
            Eager::CaptureInProgress => &mut shard.stats.eager_capture_in_progress,
            Eager::NotCapturable => &mut shard.stats.eager_not_capturable,
            Eager::CaptureFailed => &mut shard.stats.eager_capture_failed,
        };
        *counter += 1;
        result.map(|()| Outcome::EagerFallback)
    }

    fn execute_on_stream<E>(
        &self,
        call: &Call<B::Stream>,
        stream: B::Stream,
        state: StreamState,
        record: &mut impl FnMut(Option<B::Stream>) -> Result<(), E>,
        notes: &mut Notes,
    ) -> GraphResult<Outcome>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let key = &call.key;
        let device = key.device;
        let mut shard = self.lock(device);
        shard.tick += 1;
        let tick = shard.tick;
        if let Some(id) = shard.find_exact(key, state.context) {
            let entry = shard.entries.get_mut(&id).expect("indexed entry exists");
            entry.last_used = tick;
            self.backend.launch(device, &entry.exec, stream)?;
            shard.stats.hits += 1;
            return Ok(Outcome::Replayed);
        }
        let not_capturable = (key.clone(), state.context);
        if let Some(remaining) = shard.not_capturable.get_mut(&not_capturable) {
            if *remaining > 0 {
                *remaining -= 1;
                drop(shard);
                return self.eager(device, stream, Eager::NotCapturable, record, notes);
            }
            shard.not_capturable.remove(&not_capturable);
        }
        if shard
            .pending
            .iter()
            .any(|p| p.context == state.context && p.key == *key)
        {
            drop(shard);
            return self.eager(device, stream, Eager::CaptureInProgress, record, notes);
        }
        if let Some(outcome) = self.try_patch(&mut shard, call, stream, state, tick, notes)? {
            return Ok(outcome);
        }
        let pending_id = shard.next_id;
        shard.next_id += 1;
        shard.pending.push(Pending {
            id: pending_id,
            key: key.clone(),
            context: state.context,
            invalidated: false,
        });
        drop(shard);

        let (graph, launches) = match self.capture(device, stream, record) {
            Ok(captured) => captured,
            Err(step) => {
                let mut shard = self.lock(device);
                shard.take_pending(pending_id);
                shard.remember_not_capturable(not_capturable, &self.config);
                drop(shard);
                notes.failed_at = Some(step);
                return self.eager(device, stream, Eager::CaptureFailed, record, notes);
            }
        };
        match self.install(
            call,
            (stream, state),
            (pending_id, tick),
            (graph, launches),
            notes,
        )? {
            Some(outcome) => Ok(outcome),
            // The graph could not be made executable: nothing ran yet.
            None => self.eager(device, stream, Eager::CaptureFailed, record, notes),
        }
    }

    /// With [`Policy::ExecUpdate`] and a relocatable call: when a cached
    /// executable of the call's topology (the candidate an exec-update
    /// would take) is made only of
    /// kernels whose parameters the backend knows, and the call's buffers
    /// relate to each other as that executable's do ([`Relocation`]), moves
    /// its pointers to the call's buffers in place, re-keys it and launches
    /// it. `Ok(None)` when there is nothing to patch; a patch the driver
    /// refuses evicts the half-moved executable and the capture path
    /// follows.
    fn try_patch(
        &self,
        shard: &mut Shard<B>,
        call: &Call<B::Stream>,
        stream: B::Stream,
        state: StreamState,
        tick: u64,
        notes: &mut Notes,
    ) -> GraphResult<Option<Outcome>> {
        let key = &call.key;
        let device = key.device;
        if self.config.policy != Policy::ExecUpdate || !call.relocatable {
            return Ok(None);
        }
        let Some(id) =
            shard.update_candidate(key, state.context, self.config.variants_per_topology)
        else {
            return Ok(None);
        };
        let entry = shard.entries.get_mut(&id).expect("indexed entry exists");
        let (Some(patch), Some(relocation)) =
            (entry.patch.as_mut(), Relocation::between(&entry.key, key))
        else {
            return Ok(None);
        };
        let relocate = |p: u64| relocation.apply(p);
        if self
            .backend
            .patch(device, &mut entry.exec, patch, &relocate)
            .is_err()
        {
            shard.remove(id);
            shard.stats.evictions += 1;
            notes.patch_refused = true;
            return Ok(None);
        }
        shard.unindex(id);
        let entry = shard.entries.get_mut(&id).expect("entry exists");
        entry.key = key.clone();
        entry.last_used = tick;
        entry._keep_alive = call.keep_alive.clone();
        shard.index(id);
        shard.stats.patches += 1;
        self.backend
            .launch(device, &shard.entries[&id].exec, stream)?;
        Ok(Some(Outcome::Patched))
    }

    /// Captures `record`'s work on `stream`; the stream leaves capture mode
    /// whatever happens. Returns the graph and what the backend learnt of
    /// the launches in it.
    fn capture<E>(
        &self,
        device: Device,
        stream: B::Stream,
        record: &mut impl FnMut(Option<B::Stream>) -> Result<(), E>,
    ) -> Result<(B::Graph, B::Launches), &'static str> {
        self.backend
            .begin_capture(device, stream)
            .map_err(|_| "begin_capture")?;
        let (recorded, launches) = self.backend.recording(|| record(Some(stream)));
        let ended = self.backend.end_capture(device, stream);
        match (recorded, ended) {
            (Ok(()), Ok(graph)) => Ok((graph, launches)),
            (Err(_), _) => Err("record"),
            (Ok(()), Err(_)) => Err("end_capture"),
        }
    }

    /// Turns a captured graph into a cached (or updated) executable and
    /// launches it. `Ok(None)` when the graph could not be made executable
    /// (the key is then remembered as not capturable and nothing has run).
    /// `pending_id` is the capture's entry in the pending list, `tick` the
    /// call's place in the device's LRU order.
    fn install(
        &self,
        call: &Call<B::Stream>,
        (stream, state): (B::Stream, StreamState),
        (pending_id, tick): (u64, u64),
        (graph, launches): (B::Graph, B::Launches),
        notes: &mut Notes,
    ) -> GraphResult<Option<Outcome>> {
        let key = &call.key;
        let device = key.device;
        let give_up = || {
            let mut shard = self.lock(device);
            shard.take_pending(pending_id);
            shard.remember_not_capturable((key.clone(), state.context), &self.config);
        };
        let Ok(nodes) = self.backend.node_count(device, &graph) else {
            give_up();
            notes.failed_at = Some("node_count");
            return Ok(None);
        };
        notes.nodes = Some(nodes);
        if self.config.policy == Policy::ExecUpdate {
            let mut shard = self.lock(device);
            let still_valid = shard
                .pending
                .iter()
                .any(|p| p.id == pending_id && !p.invalidated);
            let candidate = still_valid
                .then(|| {
                    shard.update_candidate(key, state.context, self.config.variants_per_topology)
                })
                .flatten();
            if let Some(id) = candidate {
                let entry = shard.entries.get_mut(&id).expect("indexed entry exists");
                // A driver error here is treated like a refusal: a fresh
                // instantiation follows.
                if self
                    .backend
                    .update(device, &mut entry.exec, &graph)
                    .unwrap_or(false)
                {
                    shard.unindex(id);
                    let entry = shard.entries.get_mut(&id).expect("entry exists");
                    let old_nodes = std::mem::replace(&mut entry.nodes, nodes);
                    // The executable now runs the new graph's parameters;
                    // its patchable nodes were the old graph's.
                    entry.patch = None;
                    entry.key = key.clone();
                    entry.last_used = tick;
                    entry._keep_alive = call.keep_alive.clone();
                    shard.nodes = shard.nodes - old_nodes + nodes;
                    shard.index(id);
                    shard.take_pending(pending_id);
                    shard.stats.captures += 1;
                    shard.stats.updates += 1;
                    notes.evicted = shard.evict_to_limits(&self.config, id);
                    let entry = &shard.entries[&id];
                    self.backend.launch(device, &entry.exec, stream)?;
                    return Ok(Some(Outcome::Updated));
                }
                shard.stats.update_refusals += 1;
                notes.update_refused = true;
            }
        }
        // Instantiation is the slow step: it runs without the device's lock.
        let instantiated = self.backend.instantiate(device, &graph);
        let patch = match instantiated {
            Ok(_) if call.relocatable => self.backend.patchable(device, graph, launches),
            _ => None,
        };
        let Ok(exec) = instantiated else {
            give_up();
            notes.failed_at = Some("instantiate");
            return Ok(None);
        };
        let mut shard = self.lock(device);
        let pending = shard.take_pending(pending_id);
        shard.stats.captures += 1;
        shard.stats.instantiations += 1;
        let invalidated = pending.is_none_or(|p| p.invalidated);
        let too_big = self.config.max_nodes.is_some_and(|max| nodes > max);
        if invalidated || too_big {
            notes.not_cached = Some(if invalidated {
                "invalidated_during_capture"
            } else {
                "over_max_nodes"
            });
            // Run this once; keep nothing that may outlive its memory or
            // exceed the node limit.
            self.backend.launch(device, &exec, stream)?;
            shard.stats.evictions += 1;
            return Ok(Some(Outcome::Captured));
        }
        let id = shard.insert(Entry {
            key: key.clone(),
            context: state.context,
            exec,
            patch,
            nodes,
            last_used: tick,
            _keep_alive: call.keep_alive.clone(),
        });
        notes.evicted = shard.evict_to_limits(&self.config, id);
        self.backend
            .launch(device, &shard.entries[&id].exec, stream)?;
        Ok(Some(Outcome::Captured))
    }

    /// Evicts every graph of `device` whose buffers overlap
    /// `[address, address + bytes)`. Call it before freeing that memory: no
    /// graph that uses it can be replayed afterwards. A capture in progress
    /// that uses the range still runs once but is not cached. Returns the
    /// number of graphs evicted.
    pub fn invalidate_range(
        &self,
        device: Device,
        address: u64,
        bytes: u64,
    ) -> Result<usize, Error> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "invalidate_range needs bytes > 0".into(),
            ));
        }
        if address.checked_add(bytes).is_none() {
            return Err(Error::InvalidArgument(format!(
                "range at {address:#x} with {bytes} bytes runs past the end of the address space"
            )));
        }
        let Some(state) = self.devices.get(device) else {
            return Ok(0);
        };
        let mut shard = state.shard.lock().unwrap_or_else(|p| p.into_inner());
        let victims: Vec<u64> = shard
            .entries
            .iter()
            .filter(|(_, e)| e.key.overlaps(address, bytes))
            .map(|(id, _)| *id)
            .collect();
        for id in &victims {
            shard.remove(*id);
        }
        shard.stats.invalidations += victims.len() as u64;
        let mut captures_invalidated = 0usize;
        for p in shard
            .pending
            .iter_mut()
            .filter(|p| p.key.overlaps(address, bytes))
        {
            p.invalidated = true;
            captures_invalidated += 1;
        }
        shard
            .not_capturable
            .retain(|(k, _), _| !k.overlaps(address, bytes));
        drop(shard);
        if !victims.is_empty() || captures_invalidated > 0 {
            tracing::debug!(
                %device,
                address = %format_args!("{address:#x}"),
                bytes,
                evicted = victims.len(),
                captures_invalidated,
                "range invalidated"
            );
        }
        Ok(victims.len())
    }

    /// Evicts every graph of `device`; returns how many.
    pub fn clear(&self, device: Device) -> usize {
        let Some(state) = self.devices.get(device) else {
            return 0;
        };
        let mut shard = state.shard.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<u64> = shard.entries.keys().copied().collect();
        for id in &ids {
            shard.remove(*id);
        }
        shard.stats.invalidations += ids.len() as u64;
        for p in shard.pending.iter_mut() {
            p.invalidated = true;
        }
        shard.not_capturable.clear();
        ids.len()
    }

    /// Evicts every graph of every device, one device at a time (each
    /// device's lock is taken on its own); returns how many.
    pub fn clear_all(&self) -> usize {
        let devices: Vec<Device> = self.devices.iter().map(|(d, _)| d).collect();
        devices.into_iter().map(|d| self.clear(d)).sum()
    }

    /// Counters of `device` (all zero for a device never used).
    pub fn stats(&self, device: Device) -> Stats {
        match self.devices.get(device) {
            None => Stats::default(),
            Some(state) => {
                let shard = state.shard.lock().unwrap_or_else(|p| p.into_inner());
                Stats {
                    eager_host: state.host_runs.load(Ordering::Relaxed),
                    ..shard.stats()
                }
            }
        }
    }
}
