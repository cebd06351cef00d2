//! A live world: init step by step, finalize, and the internals every
//! transfer and collective uses.

use super::lists::{self, Lists};
use super::*;

/// Bytes reserved at offset 0 of every heap: `n` arrival words, the epoch
/// word, the error word, `n` peer pointers, `n` exchange words (one per
/// sender), [`STAGED_WORDS`] staged signal values. `n` is at most
/// [`MAX_PES`].
pub(super) fn internal_bytes(n: usize) -> usize {
    (8 * n + 16 + 8 * n + 8 * n + 8 * STAGED_WORDS).next_multiple_of(ALIGN)
}

/// The words that hold the values of signal words put through NCCL
/// ([`Live::stage_word`]), used in turn: a call's word is taken again
/// [`STAGED_WORDS`] calls later.
pub const STAGED_WORDS: usize = 64;

/// Offset of staged signal value `slot` in a heap, in a world of `n` PEs.
pub(super) fn staged_word(n: usize, slot: usize) -> u64 {
    (24 * n + 16 + 8 * slot) as u64
}

/// Offset of the exchange word that counts PE `from`'s exchanges into a
/// heap, in a world of `n` PEs.
pub(super) fn exchange_word(n: usize, from: usize) -> u64 {
    (16 * n + 16 + 8 * from) as u64
}

pub(super) enum Memory {
    Host(HostHeap),
    Cuda(crate::transport::cuda_ipc::DeviceHeap),
}

pub(super) enum PeerMap {
    /// Nothing held (finalize dropped it).
    Released,
    /// A PE of this process (this PE included): its heap, held so that it
    /// stays mapped while this PE can reach it.
    SameProcess(#[allow(dead_code)] Arc<Memory>),
    /// A PE reached through NCCL or TCP only: nothing mapped.
    Unmapped,
    Host(#[allow(dead_code)] HostMapping),
    Cuda(#[allow(dead_code)] crate::transport::cuda_ipc::IpcMapping),
}

pub(super) struct Peer {
    pub(super) device: Device,
    /// Its heap's base in this process; 0 when it is not mapped (NCCL,
    /// TCP).
    pub(super) base: u64,
    pub(super) map: PeerMap,
    pub(super) transport: Transport,
}

pub(super) struct Live {
    // Dropped first: an aborted communicator ends its kernels before the
    // memory they use goes.
    pub(super) nccl: Option<crate::transport::nccl::Comm>,
    /// The TCP connections of a Host PE's unmapped pairs.
    pub(super) mesh: Option<crate::transport::tcp::Mesh>,
    pub(super) state: StatePage,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) device: Device,
    pub(super) name: String,
    pub(super) timeout: Duration,
    pub(super) boot: Box<dyn Bootstrap>,
    pub(super) base: u64,
    pub(super) len: usize,
    pub(super) alloc: Allocator,
    pub(super) internal: usize,
    pub(super) seq: u64,
    /// Signal values staged so far ([`Live::stage_word`]).
    pub(super) staged: u64,
    pub(super) peers: Vec<Peer>,
    pub(super) stream: Option<crate::cuda::Stream>,
    // Dropped last, in this order (fields drop in declaration order).
    pub(super) memory: Arc<Memory>,
    pub(super) _binding: Binding,
}

/// Sends this PE's result to every PE; every PE returns the first failure
/// (its own first), so a step that fails anywhere fails everywhere.
pub(super) fn agree<T>(boot: &mut dyn Bootstrap, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => Vec::new(),
        Err(e) => e.encode(),
    };
    let all = boot.allgather(&msg)?;
    let local = local?;
    match all.iter().position(|m| !m.is_empty()) {
        Some(r) => Err(ShmemError::decode(r, &all[r])),
        None => Ok(local),
    }
}

/// Refuses a signal word that is not 8-byte aligned.
pub(super) fn aligned_signal(signal: u64) -> Result<()> {
    if signal % 8 != 0 {
        return Err(ShmemError::InvalidArgument(format!(
            "signal {signal:#x} is not 8-byte aligned"
        )));
    }
    Ok(())
}

/// Whether every PE says `yes` (each its own).
fn all_say(boot: &mut dyn Bootstrap, yes: bool) -> Result<bool> {
    let all = boot.allgather(&[yes as u8])?;
    Ok(all.iter().all(|a| a.as_slice() == [1]))
}

/// Whether this process's NCCL (when one loads) has one-sided operations.
fn one_sided_nccl() -> bool {
    crate::transport::nccl::library().is_ok_and(|l| l.one_sided())
}

/// A new NCCL communicator of the world's PEs (collective): rank 0's
/// unique id spread by the bootstrap, the init agreed on.
fn nccl_comm(
    boot: &mut dyn Bootstrap,
    c: &Config,
    healthy: &dyn Fn() -> Result<()>,
) -> Result<crate::transport::nccl::Comm> {
    let id = match c.rank {
        0 => crate::transport::nccl::unique_id(c.device),
        _ => Ok(Vec::new()),
    };
    let id = agree(boot, id)?;
    let id = boot.broadcast(0, &id)?;
    let comm =
        crate::transport::nccl::Comm::init(c.device, &id, c.rank, c.size, c.timeout, healthy);
    agree(boot, comm)
}

pub(super) fn fields(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .map(str::to_string)
        .collect()
}

impl Live {
    /// The checks and the device binding before a PE joins its bootstrap:
    /// (heap bytes, binding, the bootstrap's name).
    fn before_joining(c: &Config) -> Result<(usize, registry::Binding, String)> {
        if c.size == 0 || c.rank >= c.size {
            return Err(ShmemError::InvalidArgument(format!(
                "rank {} is not in a world of {} PE(s)",
                c.rank, c.size
            )));
        }
        if c.size > MAX_PES {
            return Err(ShmemError::InvalidArgument(format!(
                "a world of {} PEs is larger than the limit of {MAX_PES}",
                c.size
            )));
        }
        if c.timeout.is_zero() {
            return Err(ShmemError::InvalidArgument(
                "timeout must be above zero".into(),
            ));
        }
        let len = c.heap()?;
        c.pairs()?;
        host_identity()?;
        if c.device.platform == Platform::Cuda {
            c.device.validate()?;
        }
        let name = match &c.bootstrap {
            BootstrapKind::InProcess { group } => format!("group {group}"),
            BootstrapKind::UnixSocket { path } => format!("socket {}", path.display()),
            BootstrapKind::Tcp { address } => format!("tcp {address}"),
        };
        let binding = registry::bind(c.device, &name, c.rank)?;
        Ok((len, binding, name))
    }

    pub(super) fn init(c: &Config) -> Result<Live> {
        let (len, binding, name) = Self::before_joining(c).inspect_err(|e| {
            if let BootstrapKind::InProcess { group } = &c.bootstrap {
                // Its peers learn at once that this rank will never join
                // (every failure after the join reaches them collectively).
                crate::bootstrap::abandon(group, c.rank, c.size, c.timeout, &e.to_string());
            }
        })?;
        let started = Instant::now();
        let step = |what: &str| {
            tracing::debug!(
                bootstrap = name.as_str(),
                rank = c.rank,
                size = c.size,
                ms = %format_args!("{:.3}", started.elapsed().as_secs_f64() * 1e3),
                "init: {what}"
            )
        };
        // A failure here is logged by World::init, like every init failure.
        let joined: Box<dyn Bootstrap> = match &c.bootstrap {
            BootstrapKind::InProcess { group } => {
                Box::new(InProcess::join(group, c.rank, c.size, c.timeout)?)
            }
            BootstrapKind::UnixSocket { path } => {
                Box::new(UnixSocket::connect(path, c.rank, c.size, c.timeout)?)
            }
            BootstrapKind::Tcp { address } => {
                Box::new(Tcp::connect(address, c.rank, c.size, c.timeout)?)
            }
        };
        let mut boot: Box<dyn Bootstrap> = Box::new(Logged::new(joined, name.clone()));
        step("bootstrap joined");

        // 3. identities.
        let pairs = c.pairs()?;
        let me = format!(
            "{}\n{}\n{}\n{}\n{}\n{:?}",
            host_identity()?,
            std::process::id(),
            c.device.platform as u32,
            c.device.ordinal,
            len,
            pairs
        );
        let ids: Vec<Vec<String>> = boot
            .allgather(me.as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let devices = check_identities(&ids, c, len);
        let devices = agree(boot.as_mut(), devices)?;
        step("identities exchanged");
        let same_host = |r: usize| ids[r][0] == ids[c.rank][0];
        let same_process = |r: usize| same_host(r) && ids[r][1] == ids[c.rank][1];
        // Pairs across hosts take the platform's remote transport (CUDA:
        // NCCL, Host: TCP), and every pair when one is forced (NCCL a PE
        // with itself too).
        let remote = |r: usize| match pairs {
            Pairs::Auto => !same_host(r),
            Pairs::Nccl => true,
            Pairs::Tcp => r != c.rank,
        };
        let by_nccl = |r: usize| remote(r) && c.device.platform == Platform::Cuda;
        let by_tcp = |r: usize| remote(r) && c.device.platform == Platform::Host;
        let cross = (0..c.size).any(|r| same_host(r) && !same_process(r));
        // Some peer of another process maps this heap.
        let ipc = (0..c.size).any(|r| same_host(r) && !same_process(r) && !remote(r));

        // One-sided puts through NCCL are tried when some pair takes NCCL,
        // no pair maps the heap through IPC (NCCL's memory, which its
        // windows need, has no IPC handle) and every PE's NCCL has them.
        let nccl_pairs = (0..c.size).any(by_nccl);
        let try_one_sided = nccl_pairs && !ipc && one_sided_nccl();
        let try_one_sided = all_say(boot.as_mut(), try_one_sided)?;

        // 4. the state page of this host's PEs (its lowest rank makes it),
        // and the heap.
        let leader = (0..c.size).find(|&r| same_host(r)).unwrap_or(c.rank);
        let (state, _state_offer) = state_page(boot.as_mut(), c, leader, cross, &same_process)?;
        let shm_name = format!("/xcall-{}-{}-{}", std::process::id(), c.rank, unique());
        let memory = match c.device.platform {
            Platform::Host if ipc => HostHeap::shared(&shm_name, len).map(Memory::Host),
            Platform::Host => HostHeap::private(len).map(Memory::Host),
            Platform::Cuda if try_one_sided => {
                crate::transport::cuda_ipc::DeviceHeap::through_nccl(c.device, len)
                    .map(Memory::Cuda)
            }
            Platform::Cuda => {
                crate::transport::cuda_ipc::DeviceHeap::new(c.device, len).map(Memory::Cuda)
            }
        };
        let memory = Arc::new(agree(boot.as_mut(), memory)?);
        let heap_offer = handoff::offer(memory.clone());
        let (base, export) = match &*memory {
            Memory::Host(h) => (h.base, shm_name.clone()),
            Memory::Cuda(d) => {
                let handle = if ipc {
                    agree(boot.as_mut(), d.ipc_handle())?
                } else {
                    agree(boot.as_mut(), Ok(Vec::new()))?
                };
                (d.base, handle.iter().map(|b| format!("{b:02x}")).collect())
            }
        };

        // 5. peers.
        let descs: Vec<Vec<String>> = boot
            .allgather(format!("{base}\n{export}\n{}", heap_offer.token).as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let remote_transport = |r: usize| match c.device.platform {
            _ if !remote(r) => None,
            Platform::Cuda => Some(Transport::Nccl),
            Platform::Host => Some(Transport::Tcp),
        };
        let peers = map_peers(&descs, &devices, c, len, &same_process, &remote_transport);
        let mut peers = agree(boot.as_mut(), peers)?;
        // NCCL's communicator, when some pair takes it: rank 0's id
        // spread by the bootstrap.
        let nccl = if nccl_pairs {
            agree(boot.as_mut(), crate::transport::nccl::library().map(|_| ()))?;
            let healthy = || state.check();
            let mut comm = nccl_comm(boot.as_mut(), c, &healthy)?;
            step("NCCL communicator up");
            if try_one_sided {
                // NCCL refuses one-sided operations among ranks it cannot
                // reach that way (across hosts without its RMA support),
                // failing the communicator that asked: a communicator of
                // their own asks first. Then the heap becomes a window.
                let asked = nccl_comm(boot.as_mut(), c, &healthy)?;
                let works = agree(boot.as_mut(), asked.one_sided_works(c.timeout, &healthy))?;
                let works = all_say(boot.as_mut(), works)?;
                let windowed = match works {
                    true => comm.register_window(base, len, c.timeout, &healthy),
                    false => Ok(false),
                };
                let windowed = agree(boot.as_mut(), windowed)?;
                if all_say(boot.as_mut(), windowed)? {
                    for p in peers.iter_mut().filter(|p| p.transport == Transport::Nccl) {
                        p.transport = Transport::NcclOneSided;
                    }
                }
                step("NCCL one-sided operations asked for");
            }
            Some(comm)
        } else {
            None
        };
        // The TCP connections of the Host pairs that take them.
        let mesh = if (0..c.size).any(by_tcp) {
            let listener = crate::transport::tcp::listen(boot.local_ip());
            let listener = agree(boot.as_mut(), listener)?;
            let addresses: Vec<String> = boot
                .allgather(listener.address.as_bytes())?
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let token = match c.rank {
                0 => crate::transport::tcp::token().to_le_bytes().to_vec(),
                _ => Vec::new(),
            };
            let token = boot.broadcast(0, &token)?;
            let token =
                u64::from_le_bytes(token.as_slice().try_into().map_err(|_| {
                    ShmemError::Mismatch("rank 0 sent a malformed TCP token".into())
                })?);
            let tcp: Vec<bool> = (0..c.size).map(by_tcp).collect();
            let mesh = listener.connect(c.rank, &tcp, &addresses, token, c.timeout);
            let mesh = agree(boot.as_mut(), mesh)?;
            step("TCP pairs connected");
            Some(mesh)
        } else {
            None
        };
        for (pe, p) in peers.iter().enumerate() {
            tracing::debug!(
                rank = c.rank,
                pe,
                device = %c.device,
                peer_device = %p.device,
                transport = p.transport.name(),
                "init: peer mapped"
            );
        }

        // 6. every peer mapped this heap: drop its name and the offers.
        boot.barrier()?;
        if let Memory::Host(h) = &*memory {
            h.unlink();
        }
        if let StatePage::SameProcess(h) = &state {
            h.unlink();
        }
        drop(heap_offer);
        drop(_state_offer);

        // 7. the internal region.
        let mut alloc = Allocator::new(len);
        let internal = alloc.alloc(internal_bytes(c.size))?;
        debug_assert_eq!(internal, 0);
        let stream = match c.device.platform {
            Platform::Cuda => Some(crate::cuda::Stream::new(c.device)),
            Platform::Host => None,
        }
        .transpose();
        let stream = agree(boot.as_mut(), stream)?;
        let mut live = Live {
            nccl,
            mesh,
            state,
            rank: c.rank,
            size: c.size,
            device: c.device,
            name,
            timeout: c.timeout,
            boot,
            base,
            len,
            alloc,
            internal: internal_bytes(c.size),
            seq: 0,
            staged: 0,
            peers,
            stream,
            memory,
            _binding: binding,
        };
        let zeroed = live.init_internal();
        agree(live.boot.as_mut(), zeroed)?;
        live.boot.barrier()?;
        tracing::info!(
            bootstrap = live.name.as_str(),
            rank = c.rank,
            size = c.size,
            device = %c.device,
            heap_bytes = len,
            ms = %format_args!("{:.3}", started.elapsed().as_secs_f64() * 1e3),
            "shmem world up"
        );
        Ok(live)
    }

    /// Zeroes the internal region and writes the peer arrival-pointer
    /// table; loads the kernels on CUDA.
    pub(super) fn init_internal(&mut self) -> Result<()> {
        let n = self.size;
        let mut table = vec![0u8; self.internal];
        for (i, p) in self.peers.iter().enumerate() {
            // Peer i's arrival words, in this PE's address space.
            let at = 8 * n + 16 + 8 * i;
            table[at..at + 8].copy_from_slice(&p.base.to_le_bytes());
        }
        match &*self.memory {
            Memory::Host(_) => {
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe {
                    std::ptr::copy_nonoverlapping(table.as_ptr(), self.base as *mut u8, table.len())
                };
                Ok(())
            }
            Memory::Cuda(_) => {
                crate::cuda::kernels(self.device)?;
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe { crate::cuda::write_device(self.device, self.base, &table) }
            }
        }
    }

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

    pub(super) fn check_pe(&self, pe: usize) -> Result<()> {
        if pe >= self.size {
            return Err(ShmemError::InvalidArgument(format!(
                "PE {pe} is not in a world of {} PEs",
                self.size
            )));
        }
        Ok(())
    }

    /// PE `pe`'s address of `[local, local + bytes)`, checked to lie in one
    /// live allocation of this PE's heap (allocations are symmetric), in a
    /// healthy world: the one gate every transfer and signal passes.
    pub(super) fn remote(&self, local: u64, bytes: usize, pe: usize, what: &str) -> Result<u64> {
        let o = self.offset(local, bytes, pe, what, true)?;
        Ok(self.peers[pe].base + o as u64)
    }

    /// The heap offset of `[local, local + bytes)`, checked as
    /// [`Live::remote`] checks it, for a put into PE `pe`'s NCCL window.
    pub(super) fn window_offset(
        &self,
        local: u64,
        bytes: usize,
        pe: usize,
        what: &str,
    ) -> Result<usize> {
        self.offset(local, bytes, pe, what, false)
    }

    /// [`Live::remote`]'s checks, the peer's heap mapped when `mapped`.
    fn offset(
        &self,
        local: u64,
        bytes: usize,
        pe: usize,
        what: &str,
        mapped: bool,
    ) -> Result<usize> {
        self.state.check()?;
        self.check_pe(pe)?;
        let offset = local.checked_sub(self.base).map(|o| o as usize);
        let o = match offset {
            Some(o) if o >= self.internal && o.checked_add(bytes).is_some_and(|end| end <= self.len) => o,
            _ => return Err(ShmemError::InvalidArgument(format!(
                "{what} [{local:#x}, +{bytes}) is not inside the symmetric heap [{:#x}, {:#x}) of rank {}",
                self.base + self.internal as u64,
                self.base + self.len as u64,
                self.rank
            ))),
        };
        if mapped && matches!(self.peers[pe].map, PeerMap::Unmapped) {
            return Err(ShmemError::Unsupported(match self.peers[pe].transport {
                Transport::NcclOneSided => format!(
                    "{what}: PE {pe} is reached through NCCL, whose one-sided operations are puts: move data from it with World::exchange"
                ),
                t => format!(
                    "{what}: PE {pe} is reached through {} (two-sided): move data to it with World::exchange",
                    match t {
                        Transport::Tcp => "TCP",
                        _ => "NCCL",
                    }
                ),
            }));
        }
        // Allocations are symmetric: a block live here is live on every PE.
        if self.alloc.containing(o, bytes).is_none() {
            return Err(ShmemError::InvalidArgument(format!(
                "{what} [{local:#x}, +{bytes}) is not inside one live allocation of rank {} (freed already, or spans two objects)",
                self.rank
            )));
        }
        Ok(o)
    }

    /// Whether puts reach PE `pe` through NCCL's one-sided operations.
    pub(super) fn puts_through_nccl(&self, pe: usize) -> bool {
        self.peers.get(pe).is_some_and(|p| {
            p.transport == Transport::NcclOneSided && matches!(p.map, PeerMap::Unmapped)
        })
    }

    /// The world's NCCL communicator, unless a failure aborted it.
    pub(super) fn comm(&self) -> Result<&crate::transport::nccl::Comm> {
        self.nccl.as_ref().ok_or_else(|| {
            ShmemError::State(
                "the world's NCCL communicator was aborted after a failure; only finalize remains"
                    .into(),
            )
        })
    }

    /// Refuses a put through NCCL on a stream that captures a CUDA graph:
    /// NCCL's captured one-sided puts wait for their receiver's
    /// `ncclWaitSignal`, a call xcall's receivers never make (they poll the
    /// signal word), so a replay would wait for ever.
    pub(super) fn refuse_captured_put(
        &self,
        pe: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        // SAFETY: the caller's stream or this PE's own, live.
        if unsafe { crate::cuda::capturing(self.device, self.stream_or(stream)) }? {
            return Err(ShmemError::Unsupported(format!(
                "a put to PE {pe}, which is reached through NCCL, on a stream capturing a CUDA graph: NCCL's captured one-sided puts need a call on the receiving side; capture World::exchange instead"
            )));
        }
        Ok(())
    }

    /// One-sided puts to PE `pe` through NCCL, in order, on `stream`.
    ///
    /// # Safety
    /// Every source readable for its bytes until the stream ran the puts;
    /// every destination offset checked ([`Live::window_offset`]); the
    /// stream not capturing ([`Live::refuse_captured_put`]).
    pub(super) unsafe fn nccl_put(
        &self,
        pe: usize,
        puts: &[(u64, usize, usize)],
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        let comm = self.comm()?;
        let s = self.stream_or(stream);
        let state = &self.state;
        // SAFETY: the caller's contract; the stream is the caller's or
        // this PE's own.
        unsafe { comm.put(pe, puts, s.cast(), self.timeout, &|| state.check()) }
    }

    /// A word of this PE's internal region holding `value` once `stream`
    /// gets there: the source of a signal word put through NCCL. One of
    /// [`STAGED_WORDS`] in turn.
    pub(super) fn stage_word(
        &mut self,
        value: u64,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<u64> {
        let slot = self.staged % STAGED_WORDS as u64;
        self.staged = self.staged.wrapping_add(1);
        let word = self.base + staged_word(self.size, slot as usize);
        self.update_word(word, value, SignalOp::Set, stream)?;
        Ok(word)
    }

    pub(super) fn signal_word(&self, signal: u64, pe: usize) -> Result<u64> {
        aligned_signal(signal)?;
        self.remote(signal, 8, pe, "signal word")
    }

    /// This PE's error word: where its stream kernels (barrier, waits)
    /// leave a timeout for the next quiet.
    pub(super) fn error_word(&self) -> u64 {
        self.base + 8 * self.size as u64 + 8
    }

    /// The parameters of a wait on this PE's stream that reports `code`
    /// after the world's timeout.
    pub(super) fn wait_params(
        &self,
        signal: u64,
        value: u64,
        eq: bool,
        take: u64,
        code: WaitCode,
    ) -> crate::cuda::WaitParams {
        crate::cuda::WaitParams {
            signal,
            value,
            eq: eq as u64,
            take,
            error_word: self.error_word(),
            code: code.word(),
            timeout_ns: self.timeout_ns(),
        }
    }

    /// The world's timeout for the stream kernels that wait.
    pub(super) fn timeout_ns(&self) -> u64 {
        self.timeout.as_nanos().min(u64::MAX as u128) as u64
    }

    pub(super) fn stream_or(
        &self,
        stream: Option<*mut std::ffi::c_void>,
    ) -> cudarc::driver::sys::CUstream {
        match stream {
            Some(s) => s.cast(),
            None => self.stream.as_ref().map_or(std::ptr::null_mut(), |s| s.raw),
        }
    }

    /// # Safety
    /// Both ranges valid for `bytes`.
    pub(super) unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        match self.device.platform {
            Platform::Host => {
                // SAFETY: the caller's contract; `copy` allows overlap (a
                // put to oneself).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                fence(Ordering::Release);
                Ok(())
            }
            // SAFETY: the caller's contract.
            Platform::Cuda => unsafe {
                crate::cuda::copy(self.device, dst, src, bytes, self.stream_or(stream))
            },
        }
    }

    pub(super) fn read_word(&self, addr: u64) -> Result<u64> {
        match self.device.platform {
            // SAFETY: an aligned word of a mapped heap, accessed atomically.
            Platform::Host => Ok(unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire)),
            Platform::Cuda => {
                // SAFETY: an aligned word of this PE's heap.
                unsafe { crate::cuda::read_word(self.device, addr) }
            }
        }
    }

    pub(super) fn quiet(&mut self) -> Result<()> {
        match &self.stream {
            None => {
                fence(Ordering::SeqCst);
                Ok(())
            }
            Some(s) => {
                if let Some(comm) = &self.nccl {
                    // NCCL's kernels wait for their peers: poll, so that a
                    // failed or silent peer ends in an error, not a hang.
                    let state = &self.state;
                    let polled = crate::error::poll(self.timeout, || {
                        let idle = s.idle()?;
                        comm.progress("a transfer")?;
                        state.check()?;
                        Ok(idle)
                    })
                    .and_then(|idle| match idle {
                        true => Ok(()),
                        false => Err(ShmemError::Timeout(format!(
                            "rank {}: this PE's transfers did not complete within {:?} (a peer of an NCCL pair did not take part)",
                            self.rank, self.timeout
                        ))),
                    });
                    if let Err(e) = polled {
                        // Aborting the communicator ends its kernels; the
                        // world is failed for every PE of this host.
                        self.nccl = None;
                        self.state.fail(NCCL_FAILED, self.rank);
                        tracing::warn!(rank = self.rank, error = %e, "NCCL transfers failed; communicator aborted");
                        return Err(e);
                    }
                }
                s.sync()?;
                let err_word = self.error_word();
                let word = self.read_word(err_word)?;
                if word == 0 {
                    return Ok(());
                }
                // Clear it so the report comes once.
                // SAFETY: this PE's error word.
                unsafe { crate::cuda::write_device(self.device, err_word, &0u64.to_ne_bytes()) }?;
                let (me, t) = (self.rank, self.timeout);
                let e = ShmemError::Timeout(match WaitCode::from_word(word) {
                    Some(WaitCode::Barrier { rank }) => format!(
                        "barrier_on_stream on rank {me}: rank {rank} did not arrive within {t:?}"
                    ),
                    Some(WaitCode::Signal { .. }) => format!(
                        "wait_until_on_stream on rank {me}: the signal did not hold within {t:?}"
                    ),
                    Some(WaitCode::Exchange { sender }) => {
                        // The exchange counts are off: a later exchange
                        // could take stale data for new. Nothing more
                        // crosses this world.
                        self.state.fail(EXCHANGE_TIMED_OUT, me);
                        format!(
                            "an exchange on rank {me}'s stream: PE {sender}'s segments did not land within {t:?}; only finalize remains"
                        )
                    }
                    None => format!(
                        "rank {me}'s error word holds {word:#x}, which no xcall kernel writes"
                    ),
                });
                tracing::warn!(rank = me, error = %e, "a wait on the stream timed out");
                Err(e)
            }
        }
    }

    /// [`World::exchange`] on `stream` (`None`: this PE's own stream):
    /// the segments checked, the lists agreed on by every PE
    /// ([`Live::agree_exchange`]), then the data moved.
    ///
    /// # Safety
    /// Every outgoing `src` readable for its bytes until it completes.
    pub(super) unsafe fn exchange(
        &mut self,
        outgoing: &[Outgoing],
        incoming: &[Incoming],
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        self.state.check()?;
        let plan = self.plan_exchange(outgoing, incoming);
        let ExchangePlan {
            copies,
            sends,
            recvs,
            to,
            from,
            tcp_sends,
            tcp_recvs,
            ..
        } = self.agree_exchange(outgoing.len() + incoming.len(), plan)?;
        let (me, n) = (self.rank, self.size);
        for &(dest, src, bytes) in &copies {
            // SAFETY: `dest` was checked to lie in one allocation of the
            // peer's mapped heap; `src` is the caller's contract.
            unsafe { self.copy(dest, src, bytes, stream) }?;
        }
        // One signal per receiver, after all of its data.
        for &q in &to {
            let word = self.peers[q].base + exchange_word(n, me);
            self.update_word(word, 1, SignalOp::Add, stream)?;
        }
        if !sends.is_empty() || !recvs.is_empty() {
            let comm = self.comm()?;
            let state = &self.state;
            // SAFETY: every receive lies in this PE's heap (checked) and
            // every send is the caller's contract; the stream is the
            // caller's or this PE's own.
            unsafe {
                comm.group(
                    &sends,
                    &recvs,
                    self.stream_or(stream).cast(),
                    self.timeout,
                    &|| state.check(),
                )
            }?;
            // A graph that captured the group keeps NCCL's finalize
            // waiting until it is destroyed: finalize counts them.
            // SAFETY: the stream is live (as above).
            unsafe {
                crate::cuda::count_while_captured(
                    self.device,
                    self.stream_or(stream),
                    comm.graphs(),
                )
            }?;
        }
        if !tcp_sends.is_empty() || !tcp_recvs.is_empty() {
            let mesh = self.mesh.as_mut().ok_or_else(|| {
                ShmemError::State("this PE has no TCP pairs; only finalize remains".into())
            })?;
            // SAFETY: every receive lies in one live allocation of this
            // PE's heap (checked) and every send is the caller's
            // contract; Host memory, this thread waits for the transfers.
            unsafe { mesh.exchange(&tcp_sends, &tcp_recvs) }?;
        }
        // One wait per sender, then its count taken back.
        for &s in &from {
            let word = self.base + exchange_word(n, s);
            match self.device.platform {
                Platform::Host => {
                    let landed = crate::error::poll(self.timeout, || {
                        self.state.check()?;
                        Ok(self.read_word(word)? != 0)
                    })?;
                    if !landed {
                        return Err(ShmemError::Timeout(format!(
                            "rank {me} waited {:?} for PE {s}'s exchange segments",
                            self.timeout
                        )));
                    }
                    self.update_word(word, u64::MAX, SignalOp::Add, None)?;
                }
                Platform::Cuda => {
                    // The kernel takes the count back once it holds.
                    let p = self.wait_params(
                        word,
                        1,
                        false,
                        u64::MAX,
                        WaitCode::Exchange { sender: s },
                    );
                    // SAFETY: `word` and the error word are this PE's
                    // internal region, mapped for the world's life.
                    unsafe {
                        crate::cuda::wait_on_stream(self.device, self.stream_or(stream), &p)
                    }?;
                }
            }
        }
        Ok(())
    }

    /// Checks every segment of an exchange before anything moves, and
    /// sorts them by transport.
    fn plan_exchange(&self, outgoing: &[Outgoing], incoming: &[Incoming]) -> Result<ExchangePlan> {
        let (me, n) = (self.rank, self.size);
        let by_nccl = |pe: usize| self.peers[pe].transport.is_nccl();
        let by_tcp = |pe: usize| self.peers[pe].transport == Transport::Tcp;
        let mut p = ExchangePlan::default();
        // Which peers got a segment (sent to / received from): one signal
        // and one wait per peer, however many segments.
        let (mut sent, mut got) = (vec![false; n], vec![false; n]);
        for o in outgoing {
            self.check_pe(o.pe)?;
            // Checked as this PE's object: allocations are symmetric.
            self.remote(o.dest, o.bytes, me, "exchange destination")?;
            p.lists.send(o.pe, o.dest - self.base, o.bytes);
            if by_nccl(o.pe) {
                // The receiver writes it.
                p.sends.push(crate::transport::nccl::Segment {
                    peer: o.pe,
                    address: o.src,
                    bytes: o.bytes,
                });
            } else if by_tcp(o.pe) {
                p.tcp_sends.push(crate::transport::tcp::Segment {
                    peer: o.pe,
                    address: o.src,
                    bytes: o.bytes,
                });
            } else {
                let dest = self.remote(o.dest, o.bytes, o.pe, "exchange destination")?;
                p.copies.push((dest, o.src, o.bytes));
                if o.pe != me && !std::mem::replace(&mut sent[o.pe], true) {
                    p.to.push(o.pe);
                }
            }
        }
        for i in incoming {
            self.check_pe(i.pe)?;
            let dest = self.remote(i.dest, i.bytes, me, "exchange receive")?;
            p.lists.receive(i.pe, i.dest - self.base, i.bytes);
            if by_nccl(i.pe) {
                p.recvs.push(crate::transport::nccl::Segment {
                    peer: i.pe,
                    address: dest,
                    bytes: i.bytes,
                });
            } else if by_tcp(i.pe) {
                p.tcp_recvs.push(crate::transport::tcp::Segment {
                    peer: i.pe,
                    address: dest,
                    bytes: i.bytes,
                });
            } else if i.pe != me && !std::mem::replace(&mut got[i.pe], true) {
                p.from.push(i.pe);
            }
        }
        Ok(p)
    }

    /// Every PE's exchange lists (or the error its checks found) through
    /// the bootstrap, as a collective call numbered with the others,
    /// before anything moves: a PE whose segments were refused fails the
    /// exchange on every PE with its error, and lists that disagree fail
    /// it on every PE with [`ShmemError::Mismatch`] ([`lists::verdict`]).
    fn agree_exchange(
        &mut self,
        segments: usize,
        plan: Result<ExchangePlan>,
    ) -> Result<ExchangePlan> {
        let seq = self.seq;
        self.seq += 1;
        let mut mine = format!("exchange\n{seq}\n{segments}\n").into_bytes();
        match &plan {
            Ok(p) => {
                mine.extend_from_slice(b"ok\n");
                mine.extend_from_slice(p.lists.encode().as_bytes());
            }
            Err(e) => {
                mine.extend_from_slice(b"err\n");
                mine.extend_from_slice(&e.encode());
            }
        }
        let all = self.boot.allgather(&mine)?;
        let mut listed = Vec::with_capacity(all.len());
        let mut refused = None;
        for (r, a) in all.iter().enumerate() {
            let record = call_record(a);
            let ours = matches!(fields(record).as_slice(),
                [w, s, _] if w == "exchange" && *s == seq.to_string());
            if !ours || record.len() == a.len() {
                return Err(disagreement(seq, &all));
            }
            let body = &a[record.len() + 1..];
            if let Some(e) = body.strip_prefix(b"err\n") {
                refused.get_or_insert((r, e));
                continue;
            }
            let lists = body
                .strip_prefix(b"ok\n")
                .and_then(|l| std::str::from_utf8(l).ok())
                .and_then(Lists::decode)
                .ok_or_else(|| {
                    ShmemError::Mismatch(format!("rank {r}'s exchange #{seq} record is malformed"))
                })?;
            listed.push(lists);
        }
        let plan = plan?;
        if let Some((r, e)) = refused {
            return Err(ShmemError::decode(r, e));
        }
        lists::verdict(seq, &listed)?;
        Ok(plan)
    }

    /// Sets the signal word at `word` (an aligned word of a mapped heap) to
    /// `value`, or adds `value` to it (wrapping: `u64::MAX` takes one
    /// back); on CUDA a kernel ordered on the stream.
    pub(super) fn update_word(
        &self,
        word: u64,
        value: u64,
        op: SignalOp,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        match self.device.platform {
            Platform::Host => {
                // SAFETY: an aligned word of a mapped heap; every access
                // to signal words is atomic.
                let w = unsafe { &*(word as *const AtomicU64) };
                match op {
                    SignalOp::Set => w.store(value, Ordering::Release),
                    SignalOp::Add => {
                        w.fetch_add(value, Ordering::AcqRel);
                    }
                }
                Ok(())
            }
            Platform::Cuda => {
                let k = crate::cuda::kernels(self.device)?;
                let params = crate::cuda::SignalParams {
                    signal: word,
                    value,
                    op: op as u64,
                };
                // SAFETY: xcall_shmem_signal takes SignalParams; `word` is
                // an aligned word of a mapped heap.
                unsafe {
                    crate::cuda::launch(self.device, &k.signal, 1, self.stream_or(stream), &params)
                }
            }
        }
    }

    /// Checks that every PE makes the same collective call: (what, seq,
    /// argument) must be equal everywhere; a difference is reported on
    /// every PE with every PE's call.
    pub(super) fn collective(&mut self, what: &str, arg: u64) -> Result<()> {
        // A failed world has a PE that will never come.
        self.state.check()?;
        let seq = self.seq;
        self.seq += 1;
        let mine = format!("{what}\n{seq}\n{arg}");
        let all = self.boot.allgather(mine.as_bytes())?;
        if all.iter().all(|a| a == mine.as_bytes()) {
            return Ok(());
        }
        Err(disagreement(seq, &all))
    }

    /// Every PE's `data` (at most [`MAX_GATHER_BYTES`]) through the
    /// bootstrap, as a collective: a PE in another collective is a
    /// mismatch, and a PE offering too much makes every PE fail naming it.
    /// `offered` bytes, `data` when they fit (see
    /// [`World::allgather_offered`]).
    pub(super) fn allgather(&mut self, offered: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fits = offered <= MAX_GATHER_BYTES as u64;
        if fits && data.len() as u64 != offered {
            return Err(ShmemError::InvalidArgument(format!(
                "allgather offers {offered} bytes with {} bytes of data",
                data.len()
            )));
        }
        self.state.check()?;
        let seq = self.seq;
        self.seq += 1;
        let mut mine = format!("allgather\n{seq}\n{offered}\n").into_bytes();
        if fits {
            mine.extend_from_slice(data);
        }
        let all = self.boot.allgather(&mine)?;
        // (bytes offered, where the data starts) of an allgather #seq.
        let head = |a: &[u8]| -> Option<(usize, usize)> {
            let record = call_record(a);
            if record.len() == a.len() {
                return None;
            }
            match fields(record).as_slice() {
                [w, s, n] if w == "allgather" && *s == seq.to_string() => {
                    Some((n.parse().ok()?, record.len() + 1))
                }
                _ => None,
            }
        };
        let mut out = Vec::with_capacity(all.len());
        for (r, a) in all.iter().enumerate() {
            let Some((n, at)) = head(a) else {
                return Err(disagreement(seq, &all));
            };
            if n > MAX_GATHER_BYTES {
                return Err(ShmemError::InvalidArgument(format!(
                    "rank {r} offered {n} bytes to allgather #{seq}; at most {MAX_GATHER_BYTES} bytes per PE"
                )));
            }
            if a.len() - at != n {
                return Err(ShmemError::Mismatch(format!(
                    "rank {r}'s allgather #{seq} record is malformed"
                )));
            }
            out.push(a[at..].to_vec());
        }
        Ok(out)
    }
}

/// An exchange's segments, checked and sorted by transport, with the
/// lists its PEs agree on.
#[derive(Default)]
pub(super) struct ExchangePlan {
    /// (peer address, source, bytes) of the copies to mapped peers.
    copies: Vec<(u64, u64, usize)>,
    /// NCCL sends and receives.
    sends: Vec<crate::transport::nccl::Segment>,
    recvs: Vec<crate::transport::nccl::Segment>,
    /// The mapped peers signalled once their copies are done, and those
    /// waited for.
    to: Vec<usize>,
    from: Vec<usize>,
    /// TCP sends and receives.
    tcp_sends: Vec<crate::transport::tcp::Segment>,
    tcp_recvs: Vec<crate::transport::tcp::Segment>,
    lists: Lists,
}

/// A collective's record without its data: up to the third line break
/// (`what\nseq\narg`), or all of it.
fn call_record(record: &[u8]) -> &[u8] {
    let mut breaks = record.iter().enumerate().filter(|(_, &b)| b == b'\n');
    match breaks.nth(2) {
        Some((i, _)) => &record[..i],
        None => record,
    }
}

/// The error of collective call `seq` whose PEs made the calls `all`.
fn disagreement(seq: u64, all: &[Vec<u8>]) -> ShmemError {
    let calls: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, a)| format!("rank {r}: {}", describe_call(call_record(a))))
        .collect();
    ShmemError::Mismatch(format!(
        "PEs disagree in collective call #{seq} (malloc, free, barrier_all, allgather, exchange and finalize must be called in the same order with the same sizes on every PE): {}",
        calls.join("; ")
    ))
}

/// One PE's collective call as the others see it ("malloc #3 of 4096
/// bytes"), from its `what\nseq\narg` record.
pub(super) fn describe_call(record: &[u8]) -> String {
    let f = fields(record);
    let (what, seq, arg) = match f.as_slice() {
        [w, s, a] => (w.as_str(), s.as_str(), a.as_str()),
        _ => {
            return "a call that is not malloc, free, barrier_all, allgather, exchange or finalize"
                .into()
        }
    };
    match what {
        "malloc" => format!("malloc #{seq} of {arg} bytes"),
        "free" if arg == u64::MAX.to_string() => {
            format!("free #{seq} of an address outside the heap")
        }
        "free" => format!("free #{seq} of offset {arg}"),
        "allgather" => format!("allgather #{seq} of {arg} bytes"),
        "exchange" => format!("exchange #{seq} of {arg} segments"),
        _ => format!("{what} #{seq}"),
    }
}

/// Step 3: the devices of every rank, from their identities (`host`, `pid`,
/// platform, ordinal, heap bytes); refuses what a world cannot hold.
fn check_identities(ids: &[Vec<String>], c: &Config, len: usize) -> Result<Vec<Device>> {
    let mut devices = Vec::with_capacity(c.size);
    for (r, f) in ids.iter().enumerate() {
        if f.len() != 6 {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} sent a malformed identity"
            )));
        }
        let platform = f[2].parse().ok().and_then(Platform::from_code);
        let ordinal: Option<u32> = f[3].parse().ok();
        let (Some(platform), Some(ordinal)) = (platform, ordinal) else {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} sent a malformed device"
            )));
        };
        devices.push(Device::new(platform, ordinal));
        if platform != c.device.platform {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} is on {} and rank {} on {}: one platform per world",
                devices[r], c.rank, c.device
            )));
        }
        if f[4] != len.to_string() {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} has a heap of {} bytes, rank {} of {len}",
                f[4], c.rank
            )));
        }
        if f[5] != ids[c.rank][5] {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} takes the transport policy {} and rank {} {} (set {TRANSPORT_ENV} alike on every PE)",
                f[5], c.rank, ids[c.rank][5]
            )));
        }
        for (q, g) in ids.iter().enumerate().take(r) {
            if g[0] == f[0] && g[1] == f[1] && g[2] == f[2] && g[3] == f[3] {
                return Err(ShmemError::Mismatch(format!(
                    "ranks {q} and {r} are one process on one device ({})",
                    devices[r]
                )));
            }
        }
    }
    Ok(devices)
}

/// Step 5: maps every peer's heap from its descriptor (`base`, export,
/// offer token): same process by the offer (CUDA: after enabling peer
/// access), another process by name (Host) or IPC handle (CUDA).
fn map_peers(
    descs: &[Vec<String>],
    devices: &[Device],
    c: &Config,
    len: usize,
    same_process: &dyn Fn(usize) -> bool,
    remote: &dyn Fn(usize) -> Option<Transport>,
) -> Result<Vec<Peer>> {
    let mut peers = Vec::with_capacity(c.size);
    for (r, d) in descs.iter().enumerate() {
        let their_base: u64 = d.first().and_then(|b| b.parse().ok()).ok_or_else(|| {
            ShmemError::Mismatch(format!("rank {r} sent a malformed heap descriptor"))
        })?;
        let export = d.get(1).cloned().unwrap_or_default();
        let device = devices[r];
        match remote(r) {
            Some(transport) if r != c.rank => {
                peers.push(Peer {
                    device,
                    base: 0,
                    map: PeerMap::Unmapped,
                    transport,
                });
                continue;
            }
            _ => {}
        }
        let held = || -> Result<PeerMap> {
            let token = d.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
            handoff::take::<Memory>(token)
                .map(PeerMap::SameProcess)
                .ok_or_else(|| {
                    ShmemError::Mismatch(format!("rank {r}'s heap is not on offer in this process"))
                })
        };
        let (base, map) = match c.device.platform {
            Platform::Host if same_process(r) => (their_base, held()?),
            Platform::Host => {
                let m = HostMapping::open(&export, len)?;
                (m.base, PeerMap::Host(m))
            }
            Platform::Cuda if same_process(r) => {
                crate::transport::cuda_ipc::enable_peer_access(c.device, device, (c.rank, r))?;
                (their_base, held()?)
            }
            Platform::Cuda => {
                let bytes: Vec<u8> = (0..export.len() / 2)
                    .filter_map(|i| u8::from_str_radix(&export[2 * i..2 * i + 2], 16).ok())
                    .collect();
                let m = crate::transport::cuda_ipc::IpcMapping::open(c.device, &bytes)?;
                (m.base, PeerMap::Cuda(m))
            }
        };
        let transport = remote(r).unwrap_or_else(|| map.transport());
        peers.push(Peer {
            device,
            base,
            map,
            transport,
        });
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The internal region's layout, word by word: `n` arrival words, the
    /// epoch and error words, `n` peer pointers, `n` exchange words, then
    /// the staged signal values, each word once, all inside the region.
    #[test]
    fn every_internal_word_has_a_place_of_its_own() {
        for n in [1usize, 2, 3, 8, 1000, MAX_PES] {
            let mut words: Vec<u64> = (0..3 * n as u64 + 2).map(|i| 8 * i).collect();
            // The exchange words are the last n of the 3n + 2 before the
            // staged values.
            for from in 0..n {
                assert_eq!(exchange_word(n, from), 8 * (2 * n + 2 + from) as u64);
            }
            for slot in 0..STAGED_WORDS {
                words.push(staged_word(n, slot));
            }
            let end = internal_bytes(n) as u64;
            for (i, w) in words.iter().enumerate() {
                assert_eq!(*w, 8 * i as u64, "n {n}: word {i}");
                assert!(w + 8 <= end, "n {n}: word {i} at {w} past {end}");
            }
            assert_eq!(end % ALIGN as u64, 0);
            assert!(end < 8 * words.len() as u64 + ALIGN as u64, "n {n}: {end}");
        }
    }

    /// `all_say` is yes on every PE exactly when every PE says yes.
    #[test]
    fn every_pe_hears_yes_only_when_all_say_it() {
        let cases = [
            [true, true, true],
            [true, false, true],
            [false, false, false],
        ];
        for (case, says) in cases.into_iter().enumerate() {
            let pes: Vec<_> = (0..3)
                .map(|r| {
                    std::thread::spawn(move || {
                        let group = format!("all-say-{case}");
                        let timeout = Duration::from_secs(20);
                        let mut boot = InProcess::join(&group, r, 3, timeout).unwrap();
                        all_say(&mut boot, says[r]).unwrap()
                    })
                })
                .collect();
            let want = says.iter().all(|&s| s);
            for pe in pes {
                assert_eq!(pe.join().unwrap(), want, "case {case}: {says:?}");
            }
        }
    }
}
