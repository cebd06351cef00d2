//! Opening an XLA expert-parallel group: every device of one process at
//! once (`xcall_xla_ep_open`), or this process's devices of a group that
//! spans processes of one host (`xcall_xla_ep_open_ranks`: JAX under
//! `jax.distributed`, a process per GPU or several), meeting at a Unix
//! socket.

use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use xcall_core::{Device, Platform, Status};
use xcall_ep::{EpConfig, EpGroup};
use xcall_shmem::{World, WorldConfig};

use super::ep::{first_error, on_every_pe, open_groups, MeshGroup, Pe};
use super::frame::invalid;
use crate::ep::{config_arg, xcall_ep_config};
use crate::guard::{ffi_call, out_ptr, FfiError};

/// The longest Unix socket path (`sun_path` holds 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// A PE count from the caller (`what`: its name), in 1..=64.
fn pes_arg(v: u64, what: &str) -> Result<usize, FfiError> {
    usize::try_from(v)
        .ok()
        .filter(|n| (1..=xcall_ep::MAX_PES).contains(n))
        .ok_or_else(|| {
            invalid(format!(
                "{what} must be in 1..={}, not {v}",
                xcall_ep::MAX_PES
            ))
        })
}

/// Host worlds take slots of their own, so groups of the same host
/// "devices" may live side by side.
fn host_slots(n: usize) -> Vec<u32> {
    static NEXT: AtomicU32 = AtomicU32::new(1024);
    let first = NEXT.fetch_add(n as u32, Ordering::Relaxed);
    (0..n as u32).map(|r| first + r).collect()
}

/// Where this process's PEs meet the group's other PEs.
enum Meet {
    /// Every PE is in this process.
    InProcess,
    /// The processes meet at this Unix socket.
    Socket(String),
}

/// Makes an expert-parallel group of `config`'s shape on `count` PEs, one
/// per device of `ordinals` (rank = index), all in this process, into
/// `*out_id`, with the bytes of a dispatch's saved routing (the `routing`
/// result of the `xcall_ep_dispatch` handler) in `*out_routing_bytes`.
/// `platform` is an `xcall_platform`: CUDA (`ordinals` are device
/// ordinals) or Host (`ordinals` may be NULL: Host PEs take slots of
/// their own). Each PE's world and group are made on a thread of their
/// own, all at once, with `timeout_ms` for every wait on peers (0: 60 s);
/// the call returns when all are made. On CUDA a device may be in one live
/// group at a time. Thread-safe.
///
/// Bad input: NULL `config`, `out_id` or `out_routing_bytes`, NULL
/// `ordinals` on CUDA: `XCALL_STATUS_NULL_ARGUMENT`; an unknown platform
/// or precision, `count` 0 or above 64, a config `xcall_ep_layout` refuses
/// for `count` PEs, a CUDA ordinal listed twice:
/// `XCALL_STATUS_INVALID_ARGUMENT`; a CUDA device already in a live group
/// or world: `XCALL_STATUS_INVALID_STATE`; nothing is made. A failure on
/// one PE (out of memory, a missing device): its status, naming the PE,
/// and nothing is left made.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_open(
    platform: u32,
    ordinals: *const u32,
    count: u64,
    config: *const xcall_ep_config,
    timeout_ms: u64,
    out_id: *mut u64,
    out_routing_bytes: *mut u64,
) -> Status {
    ffi_call!({
        let ranks: Vec<usize> = (0..pes_arg(count, "count")?).collect();
        open(
            platform,
            ordinals,
            &ranks,
            count,
            Meet::InProcess,
            config,
            timeout_ms,
            out_id,
            out_routing_bytes,
        )
    })
}

/// Makes this process's `count` PEs of an expert-parallel group of `size`
/// PEs over several processes of one host, as `xcall_xla_ep_open` does for
/// one process: PE `i` here has rank `ranks[i]` and device `ordinals[i]`
/// (Host: `ordinals` may be NULL). Every process of the group calls it at
/// about the same time with the same `size`, `socket`, config and
/// timeout, together naming each rank once; the processes meet at the
/// Unix socket path `socket` (the process holding rank 0 listens there and
/// removes it once all have met), peers reached by CUDA IPC (CUDA) or
/// shared memory (Host). The call returns when every PE of the group has
/// made its part, or fails after `timeout_ms` (0: 60 s) naming what it
/// waited for. `xcall_xla_ep_close` frees this process's PEs (collective
/// over the processes). Thread-safe.
///
/// Bad input: as `xcall_xla_ep_open`, and NULL `ranks` or `socket`:
/// `XCALL_STATUS_NULL_ARGUMENT`; `size` 0 or above 64, `count` 0 or above
/// `size`, a rank listed twice or not below `size`, a `socket` that is
/// not UTF-8, empty, or longer than 107 bytes: `XCALL_STATUS_INVALID_ARGUMENT`;
/// nothing is made.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn xcall_xla_ep_open_ranks(
    platform: u32,
    ordinals: *const u32,
    ranks: *const u64,
    count: u64,
    size: u64,
    socket: *const c_char,
    config: *const xcall_ep_config,
    timeout_ms: u64,
    out_id: *mut u64,
    out_routing_bytes: *mut u64,
) -> Status {
    ffi_call!({
        if ranks.is_null() {
            return Err(FfiError::new(Status::NullArgument, "ranks is NULL"));
        }
        if socket.is_null() {
            return Err(FfiError::new(Status::NullArgument, "socket is NULL"));
        }
        let size = pes_arg(size, "size")?;
        let n = usize::try_from(count).unwrap_or(usize::MAX);
        if n == 0 || n > size {
            return Err(invalid(format!(
                "count must be in 1..={size} (the group's size), not {count}"
            )));
        }
        // SAFETY: `count` readable u64s, per the documentation.
        let given = unsafe { std::slice::from_raw_parts(ranks, n) };
        let mut list = Vec::with_capacity(n);
        for (i, &r) in given.iter().enumerate() {
            let r = usize::try_from(r).unwrap_or(usize::MAX);
            if r >= size {
                return Err(invalid(format!(
                    "ranks[{i}] is {r}; the group's ranks are 0..{size}"
                )));
            }
            if list.contains(&r) {
                return Err(invalid(format!("rank {r} is listed twice")));
            }
            list.push(r);
        }
        // SAFETY: a NUL-terminated string, per the documentation.
        let path = unsafe { CStr::from_ptr(socket) }
            .to_str()
            .map_err(|_| invalid("socket is not UTF-8".into()))?;
        if path.is_empty() || path.len() > MAX_SOCKET_PATH {
            return Err(invalid(format!(
                "socket must be a path of 1..={MAX_SOCKET_PATH} bytes, not {} bytes",
                path.len()
            )));
        }
        open(
            platform,
            ordinals,
            &list,
            size as u64,
            Meet::Socket(path.to_string()),
            config,
            timeout_ms,
            out_id,
            out_routing_bytes,
        )
    })
}

/// The two opens' shared part: `ranks` are this process's PEs (1 to
/// `size`), `size` the group's (1 to 64), both checked by the caller.
#[allow(clippy::too_many_arguments)]
fn open(
    platform: u32,
    ordinals: *const u32,
    ranks: &[usize],
    size: u64,
    meet: Meet,
    config: *const xcall_ep_config,
    timeout_ms: u64,
    out_id: *mut u64,
    out_routing_bytes: *mut u64,
) -> Result<(), FfiError> {
    let config: EpConfig = config_arg(config)?;
    let id_out = out_ptr(out_id, "out_id")?;
    let bytes_out = out_ptr(out_routing_bytes, "out_routing_bytes")?;
    let platform = crate::guard::code_arg::<Platform>(platform)?;
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    let n = ranks.len();
    let layout = config.layout(size)?;
    let ordinals = match platform {
        Platform::Host => host_slots(n),
        Platform::Cuda => {
            if ordinals.is_null() {
                return Err(FfiError::new(Status::NullArgument, "ordinals is NULL"));
            }
            // SAFETY: one readable u32 per PE of this process, per the
            // documentation.
            let o = unsafe { std::slice::from_raw_parts(ordinals, n) }.to_vec();
            if let Some(d) = o.iter().enumerate().find(|(i, d)| o[..*i].contains(d)) {
                return Err(invalid(format!("CUDA device {} is listed twice", d.1)));
            }
            let taken = open_groups().iter().find_map(|g| {
                (g.platform == Platform::Cuda)
                    .then(|| {
                        o.iter()
                            .find(|d| g.ordinals.contains(d))
                            .map(|d| (*d, g.id))
                    })
                    .flatten()
            });
            if let Some((d, id)) = taken {
                return Err(FfiError::new(
                    Status::InvalidState,
                    format!(
                        "CUDA device {d} is in open expert-parallel group {id}: a device \
                         takes part in one group at a time; close that group first"
                    ),
                ));
            }
            o
        }
    };
    let timeout = Duration::from_millis(if timeout_ms == 0 { 60_000 } else { timeout_ms });
    static WORLDS: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "xla-ep-{}-{}",
        std::process::id(),
        WORLDS.fetch_add(1, Ordering::Relaxed)
    );
    let made = on_every_pe(n, |local| -> Result<Pe, FfiError> {
        let device = Device::new(platform, ordinals[local]);
        let rank = ranks[local];
        let mut wc = match &meet {
            Meet::InProcess => WorldConfig::in_process(&name, rank, size, device),
            Meet::Socket(path) => WorldConfig::unix_socket(path, rank, size, device),
        };
        // The group's part, plus the world's internal region.
        wc.heap_bytes = Some(layout.heap_bytes.saturating_add(4 << 20));
        wc.timeout = timeout;
        let mut world = World::new();
        world.init(&wc)?;
        let group = EpGroup::new(&mut world, config)?;
        Ok(Pe {
            world,
            group: Some(group),
        })
    });
    // On a failure every PE's world is dropped (it leaves, and the memory
    // goes with the last PE), whatever was made.
    let pes = first_error(made, ranks)?;
    let routing_bytes = pes[0].group.as_ref().map_or(0, |g| g.routing_bytes());
    static IDS: AtomicU64 = AtomicU64::new(1);
    let id = IDS.fetch_add(1, Ordering::Relaxed);
    open_groups().push(Arc::new(MeshGroup {
        id,
        platform,
        ordinals,
        ranks: ranks.to_vec(),
        size,
        config,
        routing_bytes,
        pes: pes.into_iter().map(|pe| Mutex::new(Some(pe))).collect(),
    }));
    *id_out = id;
    *bytes_out = routing_bytes as u64;
    Ok(())
}
