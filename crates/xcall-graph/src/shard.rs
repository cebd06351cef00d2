//! One device's share of the cache: its entries, their exact and
//! topology indexes, the captures in progress, the keys remembered as not
//! capturable and the counters. The cache takes the shard's lock around
//! every use; nothing here locks or waits.

use std::any::Any;
use std::sync::Arc;

use rustc_hash::FxHashMap as HashMap;

use crate::backend::GraphBackend;
use crate::call::Stats;
use crate::key::CallKey;
use crate::policy::CacheConfig;

/// A cached executable and what it was made for.
pub(crate) struct Entry<B: GraphBackend> {
    pub(crate) key: CallKey,
    pub(crate) context: u64,
    pub(crate) exec: B::Exec,
    /// Set when every node is a kernel whose parameters the backend knows.
    pub(crate) patch: Option<B::Patchable>,
    pub(crate) nodes: usize,
    pub(crate) last_used: u64,
    pub(crate) _keep_alive: Vec<Arc<dyn Any + Send + Sync>>,
}

/// A capture in progress (its key runs eagerly on other threads meanwhile).
pub(crate) struct Pending {
    pub(crate) id: u64,
    pub(crate) key: CallKey,
    pub(crate) context: u64,
    /// Set when an overlapping `invalidate_range` or a `clear` ran during
    /// the capture: the graph may run once but must not be cached.
    pub(crate) invalidated: bool,
}

/// The state of one device, behind its lock.
pub(crate) struct Shard<B: GraphBackend> {
    pub(crate) entries: HashMap<u64, Entry<B>>,
    pub(crate) exact: HashMap<u64, Vec<u64>>,
    pub(crate) topology: HashMap<u64, Vec<u64>>,
    pub(crate) pending: Vec<Pending>,
    pub(crate) not_capturable: HashMap<(CallKey, u64), u32>,
    pub(crate) tick: u64,
    pub(crate) next_id: u64,
    pub(crate) nodes: usize,
    pub(crate) stats: Stats,
    /// [`CacheConfig::bucket_mask`].
    pub(crate) mask: u64,
}

impl<B: GraphBackend> Shard<B> {
    pub(crate) fn new(mask: u64) -> Self {
        Shard {
            mask,
            entries: HashMap::default(),
            exact: HashMap::default(),
            topology: HashMap::default(),
            pending: Vec::new(),
            not_capturable: HashMap::default(),
            tick: 0,
            next_id: 0,
            nodes: 0,
            stats: Stats::default(),
        }
    }

    pub(crate) fn find_exact(&self, key: &CallKey, context: u64) -> Option<u64> {
        self.exact
            .get(&(key.bucket() & self.mask))?
            .iter()
            .copied()
            .find(|id| {
                let e = &self.entries[id];
                e.context == context && e.key == *key
            })
    }

    /// The least recently used entry of `key`'s topology, if there are at
    /// least `variants` of them.
    pub(crate) fn update_candidate(
        &self,
        key: &CallKey,
        context: u64,
        variants: usize,
    ) -> Option<u64> {
        let ids: Vec<u64> = self
            .topology
            .get(&(key.topology_bucket() & self.mask))?
            .iter()
            .copied()
            .filter(|id| {
                let e = &self.entries[id];
                e.context == context && e.key.same_topology(key)
            })
            .collect();
        if ids.len() < variants {
            return None;
        }
        ids.into_iter().min_by_key(|id| self.entries[id].last_used)
    }

    pub(crate) fn index(&mut self, id: u64) {
        let key = &self.entries[&id].key;
        self.exact
            .entry(key.bucket() & self.mask)
            .or_default()
            .push(id);
        self.topology
            .entry(key.topology_bucket() & self.mask)
            .or_default()
            .push(id);
    }

    pub(crate) fn unindex(&mut self, id: u64) {
        let key = &self.entries[&id].key;
        for (map, bucket) in [
            (&mut self.exact, key.bucket() & self.mask),
            (&mut self.topology, key.topology_bucket() & self.mask),
        ] {
            if let Some(ids) = map.get_mut(&bucket) {
                ids.retain(|x| *x != id);
                if ids.is_empty() {
                    map.remove(&bucket);
                }
            }
        }
    }

    pub(crate) fn insert(&mut self, entry: Entry<B>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.nodes += entry.nodes;
        self.entries.insert(id, entry);
        self.index(id);
        id
    }

    pub(crate) fn remove(&mut self, id: u64) -> Option<Entry<B>> {
        if !self.entries.contains_key(&id) {
            return None;
        }
        self.unindex(id);
        let entry = self.entries.remove(&id)?;
        self.nodes -= entry.nodes;
        Some(entry)
    }

    /// Evicts least recently used entries (never `keep`) until the shard is
    /// within its limits; returns how many.
    pub(crate) fn evict_to_limits(&mut self, config: &CacheConfig, keep: u64) -> usize {
        let mut evicted = 0;
        loop {
            let over_capacity = self.entries.len() > config.capacity;
            let over_nodes = config.max_nodes.is_some_and(|max| self.nodes > max);
            if !over_capacity && !over_nodes {
                return evicted;
            }
            let victim = self
                .entries
                .iter()
                .filter(|(id, _)| **id != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| *id);
            match victim {
                Some(id) => {
                    self.remove(id);
                    self.stats.evictions += 1;
                    evicted += 1;
                }
                None => return evicted,
            }
        }
    }

    /// Remembers that `key` in `context` could not be captured: it runs
    /// eagerly for `retry_after` calls. The memory is bounded like the cache.
    pub(crate) fn remember_not_capturable(&mut self, key: (CallKey, u64), config: &CacheConfig) {
        self.not_capturable.insert(key, config.retry_after);
        while self.not_capturable.len() > config.capacity {
            let Some(k) = self.not_capturable.keys().next().cloned() else {
                break;
            };
            self.not_capturable.remove(&k);
        }
    }

    pub(crate) fn take_pending(&mut self, id: u64) -> Option<Pending> {
        let at = self.pending.iter().position(|p| p.id == id)?;
        Some(self.pending.swap_remove(at))
    }

    pub(crate) fn stats(&self) -> Stats {
        Stats {
            entries: self.entries.len() as u64,
            nodes: self.nodes as u64,
            ..self.stats
        }
    }
}
