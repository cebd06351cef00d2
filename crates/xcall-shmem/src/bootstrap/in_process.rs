//! PEs that are threads of one process, meeting by group name.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::{check_rank, missing, Bootstrap};
use crate::error::{Result, ShmemError};

/// One round of an in-process collective.
struct Round {
    data: Vec<Option<Vec<u8>>>,
    arrived: usize,
    left: usize,
}

struct GroupState {
    joined: Vec<bool>,
    members: usize,
    rounds: HashMap<u64, Round>,
    /// The error every later collective of the group returns, and when it
    /// was recorded (a failed group nobody joined expires after
    /// `expires`, so its name can be used again).
    failed: Option<(ShmemError, Instant)>,
    expires: Duration,
    /// The rank whose failure before joining failed the group.
    abandoned_by: Option<usize>,
}

struct Group {
    name: String,
    size: usize,
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        // A panic on another PE's thread must not wedge this one: the state
        // is only counters and buffers, valid after any interrupted update.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn groups() -> &'static Mutex<HashMap<String, Arc<Group>>> {
    static GROUPS: OnceLock<Mutex<HashMap<String, Arc<Group>>>> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

/// Whether in-process group `name` exists (some member is joined).
pub fn group_alive(name: &str) -> bool {
    groups()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(name)
}

/// PEs that are threads of this process, meeting by group name.
pub struct InProcess {
    group: Arc<Group>,
    rank: usize,
    seq: u64,
    timeout: Duration,
}

impl InProcess {
    /// Joins group `name` of `size` PEs as `rank`. The group exists while
    /// at least one member is joined; a name is reusable once every member
    /// left.
    pub fn join(name: &str, rank: usize, size: usize, timeout: Duration) -> Result<InProcess> {
        check_rank(rank, size)?;
        let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
        let group = group_entry(&mut all, name, size, timeout, Some(rank));
        if group.size != size {
            return Err(ShmemError::Mismatch(format!(
                "group {name:?} has {} PEs, rank {rank} asked for {size}",
                group.size
            )));
        }
        let mut st = group.lock();
        if let Some((e, _)) = &st.failed {
            return Err(e.clone());
        }
        if st.joined[rank] {
            return Err(ShmemError::State(format!(
                "rank {rank} of group {name:?} is already joined (two PEs with one rank, or init twice)"
            )));
        }
        st.joined[rank] = true;
        st.members += 1;
        drop(st);
        Ok(InProcess {
            group,
            rank,
            seq: 0,
            timeout,
        })
    }
}

/// Group `name` of `size` PEs: the live one, or a new one in its place
/// when there is none or the one there failed with nobody joined and its
/// failure has expired or is the failure of `joining`, the rank that
/// joins now (a PE retrying its init after its own failure).
fn group_entry(
    all: &mut HashMap<String, Arc<Group>>,
    name: &str,
    size: usize,
    timeout: Duration,
    joining: Option<usize>,
) -> Arc<Group> {
    let stale = all.get(name).is_some_and(|g| {
        let st = g.lock();
        let retry = joining.is_some() && st.abandoned_by == joining;
        st.members == 0
            && st
                .failed
                .as_ref()
                .is_some_and(|(_, at)| retry || at.elapsed() >= st.expires)
    });
    if stale {
        all.remove(name);
    }
    all.entry(name.to_string())
        .or_insert_with(|| {
            Arc::new(Group {
                name: name.to_string(),
                size,
                state: Mutex::new(GroupState {
                    joined: vec![false; size],
                    members: 0,
                    rounds: HashMap::new(),
                    failed: None,
                    expires: timeout,
                    abandoned_by: None,
                }),
                changed: Condvar::new(),
            })
        })
        .clone()
}

/// Rank `rank` of in-process group `name` failed before it could join:
/// the group fails at once (its members' waits and every later join and
/// collective return [`ShmemError::PeerFailed`] naming `reason`) instead
/// of waiting out their timeouts for a rank that will never arrive. A
/// failed group nobody joins is forgotten after `timeout`, or when `rank`
/// itself joins again. A group of another size is left alone (its own
/// join reports the mismatch).
pub fn abandon(name: &str, rank: usize, size: usize, timeout: Duration, reason: &str) {
    if check_rank(rank, size).is_err() {
        return; // no group can have this rank
    }
    let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
    let group = group_entry(&mut all, name, size, timeout, None);
    if group.size != size {
        return;
    }
    let mut st = group.lock();
    if st.failed.is_none() {
        st.failed = Some((
            ShmemError::PeerFailed(format!(
                "group {name:?}: rank {rank} failed before joining: {reason}"
            )),
            Instant::now(),
        ));
        // A zero timeout (itself refused) still keeps the failure a while.
        st.expires = timeout.max(Duration::from_secs(1));
        st.abandoned_by = Some(rank);
    }
    drop(st);
    group.changed.notify_all();
}

impl Bootstrap for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (g, n, seq) = (&self.group, self.group.size, self.seq);
        self.seq += 1;
        let deadline = Instant::now() + self.timeout;
        let mut st = g.lock();
        if let Some((e, _)) = &st.failed {
            return Err(e.clone());
        }
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            data: vec![None; n],
            arrived: 0,
            left: 0,
        });
        round.data[self.rank] = Some(data.to_vec());
        round.arrived += 1;
        g.changed.notify_all();
        loop {
            if st.rounds[&seq].arrived == n {
                break;
            }
            if let Some((e, _)) = &st.failed {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let arrived: Vec<bool> = st.rounds[&seq].data.iter().map(Option::is_some).collect();
                let msg = format!(
                    "group {:?}: rank {} waited {:?} in collective #{seq} for rank(s) {:?}, which never arrived",
                    g.name,
                    self.rank,
                    self.timeout,
                    missing(&arrived)
                );
                st.failed = Some((ShmemError::Timeout(msg.clone()), Instant::now()));
                g.changed.notify_all();
                return Err(ShmemError::Timeout(msg));
            }
            st = g
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let round = st
            .rounds
            .get_mut(&seq)
            .expect("round exists until all left");
        let out = round
            .data
            .iter()
            .map(|d| d.clone().unwrap_or_default())
            .collect();
        round.left += 1;
        if round.left == n {
            st.rounds.remove(&seq);
        }
        Ok(out)
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.group.lock();
        st.joined[self.rank] = false;
        st.members -= 1;
        let last = st.members == 0;
        drop(st);
        if last
            && all
                .get(&self.group.name)
                .is_some_and(|g| Arc::ptr_eq(g, &self.group))
        {
            all.remove(&self.group.name);
        }
    }
}
