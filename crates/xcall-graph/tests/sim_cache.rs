// Over 600 lines: every behaviour of the cache on the simulated backend, sharing its fixtures.
//! The cache's logic on the simulated multi-device backend (no GPU needed).

use std::sync::{Arc, Barrier};

use xcall_core::testing::{run_threads, watchdog, within};
use xcall_graph::sim::{SimBackend, SimOp, SimStream};
use xcall_graph::{
    op_id, Attributes, Buffer, BufferRole, CacheConfig, Call, CallKey, Device, GraphCache, OpCall,
    Outcome, Policy, Stats,
};

#[path = "common/sim.rs"]
mod sim;
use sim::{add, cache, key, run, run_ops, stream};

#[test]
fn identical_calls_capture_once_then_replay() {
    let c = cache(CacheConfig::default());
    let k = key(0, 1, &[0x1000, 0x2000]);
    assert_eq!(run(&c, &k, stream(0), 1), Outcome::Captured);
    for _ in 0..5 {
        assert_eq!(run(&c, &k, stream(0), 1), Outcome::Replayed);
    }
    // The replays run the captured work: six additions per buffer.
    assert_eq!(c.backend().read(Device::cuda(0), 0x1000), 6);
    assert_eq!(c.backend().read(Device::cuda(0), 0x2000), 6);
    let s = c.stats(Device::cuda(0));
    assert_eq!(
        (s.captures, s.instantiations, s.hits, s.entries, s.nodes),
        (1, 1, 5, 1, 2)
    );
}

#[test]
fn same_addresses_on_two_devices_never_share_a_graph() {
    // Both devices hand out the same virtual address: the key's device
    // must keep their graphs apart.
    let c = cache(CacheConfig::default());
    for ordinal in [0, 1] {
        let k = key(ordinal, 1, &[0x7f00_0000]);
        assert_eq!(
            run(&c, &k, stream(ordinal), 10 + ordinal as i64),
            Outcome::Captured
        );
    }
    for _ in 0..3 {
        for ordinal in [0, 1] {
            let k = key(ordinal, 1, &[0x7f00_0000]);
            assert_eq!(run(&c, &k, stream(ordinal), 999), Outcome::Replayed);
        }
    }
    // Each device replayed its own graph (its own value), on its own memory.
    assert_eq!(c.backend().read(Device::cuda(0), 0x7f00_0000), 40);
    assert_eq!(c.backend().read(Device::cuda(1), 0x7f00_0000), 44);
    assert_eq!(c.backend().violations(), 0);
    assert_eq!(c.stats(Device::cuda(0)).entries, 1);
    assert_eq!(c.stats(Device::cuda(1)).entries, 1);
}

#[test]
fn a_stream_of_another_device_is_refused_before_anything_runs() {
    let c = cache(CacheConfig::default());
    let call = Call::new(key(0, 1, &[0x10]), Some(stream(1)));
    let mut ran = false;
    let err = c
        .execute(&call, |_| {
            ran = true;
            Ok::<(), std::io::Error>(())
        })
        .unwrap_err();
    assert_eq!(err.status(), xcall_core::Status::InvalidArgument);
    assert!(
        err.to_string()
            .contains("the stream belongs to cuda:1, the call names cuda:0"),
        "{err}"
    );
    assert!(!ran);
    let no_stream = Call::new(key(0, 1, &[0x10]), None);
    let err = c
        .execute(&no_stream, |_| Ok::<(), std::io::Error>(()))
        .unwrap_err();
    assert!(err.to_string().contains("needs a stream"), "{err}");
    let no_buffers = Call::new(key(0, 1, &[]), Some(stream(0)));
    let err = c
        .execute(&no_buffers, |_| Ok::<(), std::io::Error>(()))
        .unwrap_err();
    assert!(err.to_string().contains("at least one buffer"), "{err}");
    assert_eq!(c.stats(Device::cuda(0)), Stats::default());
}

#[test]
fn pointer_churn_updates_the_executable_in_place() {
    let c = cache(CacheConfig::default());
    let a = key(0, 1, &[0x100]);
    let b = key(0, 1, &[0x200]);
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
    assert_eq!(run(&c, &b, stream(0), 1), Outcome::Updated);
    assert_eq!(run(&c, &b, stream(0), 1), Outcome::Replayed);
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Updated);
    // The updated executable writes the new buffer and not the old one.
    assert_eq!(c.backend().read(Device::cuda(0), 0x100), 2);
    assert_eq!(c.backend().read(Device::cuda(0), 0x200), 2);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.instantiations, s.updates, s.entries), (1, 2, 1));
    // Another topology (different size) is never an update candidate.
    let mut bigger = key(0, 1, &[0x300]);
    bigger.buffers[0].bytes = 128;
    assert_eq!(run(&c, &bigger, stream(0), 1), Outcome::Captured);
}

#[test]
fn refused_update_instantiates_instead() {
    let c = cache(CacheConfig::default());
    let a = key(0, 1, &[0x100]);
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
    // Same key topology, but the work has two nodes now: the update is refused.
    let b = key(0, 1, &[0x200]);
    let outcome = run_ops(&c, &b, stream(0), &[add(0x200, 1), add(0x201, 1)]);
    assert_eq!(outcome, Outcome::Captured);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.update_refusals, s.instantiations, s.entries), (1, 2, 2));
}

#[test]
fn recapture_policy_and_variants_keep_several_executables() {
    let c = cache(CacheConfig {
        policy: Policy::Recapture,
        ..CacheConfig::default()
    });
    assert_eq!(
        run(&c, &key(0, 1, &[0x100]), stream(0), 1),
        Outcome::Captured
    );
    assert_eq!(
        run(&c, &key(0, 1, &[0x200]), stream(0), 1),
        Outcome::Captured
    );
    assert_eq!(
        run(&c, &key(0, 1, &[0x100]), stream(0), 1),
        Outcome::Replayed
    );
    assert_eq!(c.stats(Device::cuda(0)).updates, 0);

    let c = cache(CacheConfig {
        variants_per_topology: 2,
        ..CacheConfig::default()
    });
    assert_eq!(
        run(&c, &key(0, 1, &[0x100]), stream(0), 1),
        Outcome::Captured
    );
    assert_eq!(
        run(&c, &key(0, 1, &[0x200]), stream(0), 1),
        Outcome::Captured
    );
    for _ in 0..3 {
        assert_eq!(
            run(&c, &key(0, 1, &[0x100]), stream(0), 1),
            Outcome::Replayed
        );
        assert_eq!(
            run(&c, &key(0, 1, &[0x200]), stream(0), 1),
            Outcome::Replayed
        );
    }
    // A third address set updates the least recently used variant (0x100).
    assert_eq!(
        run(&c, &key(0, 1, &[0x300]), stream(0), 1),
        Outcome::Updated
    );
    assert_eq!(
        run(&c, &key(0, 1, &[0x200]), stream(0), 1),
        Outcome::Replayed
    );
}

#[test]
fn disabled_policy_always_runs_eagerly() {
    let c = cache(CacheConfig {
        policy: Policy::Disabled,
        ..CacheConfig::default()
    });
    for _ in 0..3 {
        assert_eq!(
            run(&c, &key(0, 1, &[0x100]), stream(0), 1),
            Outcome::EagerFallback
        );
    }
    assert_eq!(c.backend().read(Device::cuda(0), 0x100), 3);
    assert_eq!(c.stats(Device::cuda(0)).eager_disabled, 3);
    assert_eq!(c.backend().launches(), 0);
}

#[test]
fn lru_capacity_per_device() {
    let c = cache(CacheConfig {
        capacity: 2,
        ..CacheConfig::default()
    });
    let keys: Vec<CallKey> = (1..=3).map(|t| key(0, t, &[0x100 * t])).collect();
    run(&c, &keys[0], stream(0), 1);
    run(&c, &keys[1], stream(0), 1);
    assert_eq!(run(&c, &keys[0], stream(0), 1), Outcome::Replayed); // keys[1] is now LRU
    assert_eq!(run(&c, &keys[2], stream(0), 1), Outcome::Captured); // evicts keys[1]
    assert_eq!(run(&c, &keys[0], stream(0), 1), Outcome::Replayed);
    assert_eq!(run(&c, &keys[1], stream(0), 1), Outcome::Captured);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.entries, s.evictions), (2, 2));
    // Another device's capacity is its own.
    run(&c, &key(1, 1, &[0x100]), stream(1), 1);
    assert_eq!(c.stats(Device::cuda(1)).evictions, 0);
}

#[test]
fn node_limit_per_device() {
    let c = cache(CacheConfig {
        max_nodes: Some(3),
        ..CacheConfig::default()
    });
    let two = key(0, 1, &[0x100, 0x200]);
    let two_more = key(0, 2, &[0x300, 0x400]);
    run(&c, &two, stream(0), 1);
    run(&c, &two_more, stream(0), 1); // 4 nodes > 3: the older graph goes
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.entries, s.nodes, s.evictions), (1, 2, 1));
    // A graph larger than the limit runs once and is not kept.
    let four = key(0, 3, &[1, 2, 3, 4]);
    assert_eq!(run(&c, &four, stream(0), 5), Outcome::Captured);
    assert_eq!(c.backend().read(Device::cuda(0), 4), 5);
    assert_eq!(run(&c, &four, stream(0), 5), Outcome::Captured);
    assert_eq!(c.stats(Device::cuda(0)).entries, 1);
}

#[test]
fn invalidate_range_evicts_exactly_the_overlapping_graphs() {
    let c = cache(CacheConfig::default());
    let a = key(0, 1, &[0x1000]); // [0x1000, 0x1040)
    let b = key(0, 2, &[0x2000]);
    run(&c, &a, stream(0), 1);
    run(&c, &b, stream(0), 1);
    run(&c, &key(1, 1, &[0x1000]), stream(1), 1);
    // Adjacent ranges do not overlap.
    assert_eq!(
        c.invalidate_range(Device::cuda(0), 0x1040, 0x100).unwrap(),
        0
    );
    assert_eq!(
        c.invalidate_range(Device::cuda(0), 0x0f00, 0x101).unwrap(),
        1
    );
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
    assert_eq!(run(&c, &b, stream(0), 1), Outcome::Replayed);
    // Other devices are untouched.
    assert_eq!(
        run(&c, &key(1, 1, &[0x1000]), stream(1), 1),
        Outcome::Replayed
    );
    assert!(c.invalidate_range(Device::cuda(0), 0x10, 0).is_err());
    assert!(c.invalidate_range(Device::cuda(0), u64::MAX, 2).is_err());
    assert_eq!(c.invalidate_range(Device::cuda(7), 0, 1).unwrap(), 0);
    assert_eq!(c.clear(Device::cuda(0)), 2);
    assert_eq!(c.clear_all(), 1);
    assert_eq!(c.stats(Device::cuda(0)).invalidations, 3);
}

#[test]
fn invalidation_during_a_capture_keeps_the_graph_out_of_the_cache() {
    // Under the watchdog: a lock held across the record function would
    // deadlock this thread.
    within("invalidate inside a record function", watchdog(), || {
        let c = cache(CacheConfig::default());
        let k = key(0, 1, &[0x1000]);
        let call = Call::new(k.clone(), Some(stream(0)));
        // The record function itself frees the memory (no lock is held while it
        // runs, so this cannot deadlock).
        let outcome = c
            .execute(&call, |s| {
                c.backend().enqueue(
                    s.unwrap(),
                    SimOp::Add {
                        address: 0x1000,
                        value: 1,
                    },
                );
                c.invalidate_range(Device::cuda(0), 0x1000, 1).map(|_| ())
            })
            .unwrap();
        assert_eq!(outcome, Outcome::Captured);
        assert_eq!(c.backend().read(Device::cuda(0), 0x1000), 1);
        assert_eq!(c.stats(Device::cuda(0)).entries, 0);
        assert_eq!(run(&c, &k, stream(0), 1), Outcome::Captured);
    });
}

#[test]
fn failed_captures_run_eagerly_and_retry_later() {
    let c = cache(CacheConfig {
        retry_after: 2,
        ..CacheConfig::default()
    });
    let k = key(0, 1, &[0x100]);
    let uncapturable = |c: &GraphCache<SimBackend>| {
        run_ops(c, &k, stream(0), &[SimOp::Uncapturable, add(0x100, 1)])
    };
    assert_eq!(uncapturable(&c), Outcome::EagerFallback); // capture failed, ran eagerly
    assert_eq!(uncapturable(&c), Outcome::EagerFallback); // remembered
    assert_eq!(uncapturable(&c), Outcome::EagerFallback); // remembered
    assert_eq!(uncapturable(&c), Outcome::EagerFallback); // retried, failed again

    // Every call's work ran exactly once.
    assert_eq!(c.backend().read(Device::cuda(0), 0x100), 4);
    let s = c.stats(Device::cuda(0));
    assert_eq!(
        (s.eager_capture_failed, s.eager_not_capturable, s.entries),
        (2, 2, 0)
    );
    // The stream left capture mode: a capturable call on it works.
    assert_eq!(
        run(&c, &key(0, 2, &[0x200]), stream(0), 1),
        Outcome::Captured
    );
}

#[test]
fn a_failing_record_function_returns_its_error() {
    let c = cache(CacheConfig::default());
    let call = Call::new(key(0, 1, &[0x100]), Some(stream(0)));
    let mut calls = 0;
    let err = c
        .execute(&call, |_| {
            calls += 1;
            Err(std::io::Error::other("kernel launch refused"))
        })
        .unwrap_err();
    assert_eq!(calls, 2, "once under capture, once eagerly");
    assert_eq!(err.status(), xcall_core::Status::CallbackFailed);
    assert!(err.to_string().contains("kernel launch refused"), "{err}");
    // Fails during capture, succeeds eagerly: the eager result is returned.
    let mut first = true;
    let outcome = c
        .execute(&Call::new(key(0, 2, &[0x200]), Some(stream(0))), |_| {
            let fail = std::mem::take(&mut first);
            if fail {
                Err(std::io::Error::other("transient"))
            } else {
                Ok(())
            }
        })
        .unwrap();
    assert_eq!(outcome, Outcome::EagerFallback);
}

#[test]
fn a_stream_the_caller_is_capturing_records_into_the_callers_capture() {
    let c = cache(CacheConfig::default());
    let s = stream(0);
    c.backend().begin_caller_capture(s);
    assert_eq!(run(&c, &key(0, 1, &[0x100]), s, 3), Outcome::EagerFallback);
    let recorded = c.backend().end_caller_capture(s);
    assert_eq!(
        recorded,
        vec![SimOp::Add {
            address: 0x100,
            value: 3
        }]
    );
    assert_eq!(
        c.backend().read(Device::cuda(0), 0x100),
        0,
        "not run, recorded"
    );
    let st = c.stats(Device::cuda(0));
    assert_eq!((st.eager_caller_capturing, st.captures), (1, 0));
}

#[test]
fn racing_threads_on_one_new_key_capture_once() {
    // Barriers between two threads: under the watchdog, a hang fails.
    within("racing capture", watchdog(), || {
        let c = Arc::new(cache(CacheConfig::default()));
        let k = key(0, 1, &[0x100]);
        let inside = Arc::new(Barrier::new(2));
        let release = Arc::new(Barrier::new(2));
        let capturer = {
            let (c, k, inside, release) = (c.clone(), k.clone(), inside.clone(), release.clone());
            std::thread::spawn(move || {
                let call = Call::new(k, Some(stream(0)));
                c.execute(&call, |s| {
                    c.backend().enqueue(
                        s.unwrap(),
                        SimOp::Add {
                            address: 0x100,
                            value: 1,
                        },
                    );
                    inside.wait(); // the capture is in progress...
                    release.wait(); // ...until the other thread has run
                    Ok::<(), std::io::Error>(())
                })
                .unwrap()
            })
        };
        inside.wait();
        let other = SimStream { id: 2, ..stream(0) };
        assert_eq!(run(&c, &k, other, 1), Outcome::EagerFallback);
        release.wait();
        assert_eq!(capturer.join().unwrap(), Outcome::Captured);
        let s = c.stats(Device::cuda(0));
        assert_eq!((s.captures, s.eager_capture_in_progress), (1, 1));
        assert_eq!(c.backend().read(Device::cuda(0), 0x100), 2);
    });
}

#[test]
fn stress_8_threads_4_devices_random_keys() {
    const THREADS: u64 = 8;
    const DEVICES: u32 = 4;
    const CALLS: u64 = 2000;
    let c = Arc::new(cache(CacheConfig {
        capacity: 6,
        ..CacheConfig::default()
    }));
    let results = {
        let c = c.clone();
        run_threads("stress", THREADS as usize, watchdog(), move |t| {
            let t = t as u64;
            {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                let mut tally: Vec<[u64; 5]> = vec![[0; 5]; DEVICES as usize];
                let mut adds = std::collections::HashMap::new();
                for _ in 0..CALLS {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let ordinal = (rng % DEVICES as u64) as u32;
                    let target = (rng >> 8) % 5;
                    // Addresses are drawn from the same small set on every device.
                    let address = 0x1000 * ((rng >> 16) % 4 + 1);
                    let k = key(ordinal, target, &[address]);
                    let s = SimStream {
                        id: t,
                        ..stream(ordinal)
                    };
                    let outcome = run(&c, &k, s, 1 + ordinal as i64);
                    tally[ordinal as usize][outcome as usize] += 1;
                    *adds.entry((ordinal, address)).or_insert(0i64) += 1 + ordinal as i64;
                }
                (tally, adds)
            }
        })
    };
    let mut tally = vec![[0u64; 5]; DEVICES as usize];
    let mut expected = std::collections::HashMap::new();
    for (t, adds) in results {
        for d in 0..DEVICES as usize {
            for o in 0..5 {
                tally[d][o] += t[d][o];
            }
        }
        for (k, v) in adds {
            *expected.entry(k).or_insert(0) += v;
        }
    }
    assert_eq!(c.backend().violations(), 0, "a graph ran on another device");
    // Every call's work ran exactly once, on its own device.
    for ((ordinal, address), want) in expected {
        assert_eq!(
            c.backend().read(Device::cuda(ordinal), address),
            want,
            "cuda:{ordinal} {address:#x}"
        );
    }
    // The stats add up with what the calls returned.
    for d in 0..DEVICES {
        let s = c.stats(Device::cuda(d));
        let t = tally[d as usize];
        assert_eq!(s.hits, t[Outcome::Replayed as usize]);
        assert_eq!(s.updates, t[Outcome::Updated as usize]);
        assert_eq!(s.captures - s.updates, t[Outcome::Captured as usize]);
        let eager = s.eager_disabled
            + s.eager_caller_capturing
            + s.eager_capture_in_progress
            + s.eager_not_capturable
            + s.eager_capture_failed;
        assert_eq!(eager, t[Outcome::EagerFallback as usize]);
        assert!(s.entries <= 6);
    }
    let total: u64 = tally.iter().flatten().sum();
    assert_eq!(total, THREADS * CALLS);
}

#[test]
fn a_graph_that_cannot_be_instantiated_runs_eagerly_once() {
    let c = cache(CacheConfig {
        retry_after: 1,
        ..CacheConfig::default()
    });
    let k = key(0, 1, &[0x100]);
    let run_it = |c: &GraphCache<SimBackend>| {
        run_ops(c, &k, stream(0), &[SimOp::FailsInstantiate, add(0x100, 1)])
    };
    assert_eq!(run_it(&c), Outcome::EagerFallback); // captured, not instantiable: ran eagerly
    assert_eq!(run_it(&c), Outcome::EagerFallback); // remembered
    assert_eq!(
        c.backend().read(Device::cuda(0), 0x100),
        2,
        "each call's work ran exactly once"
    );
    let s = c.stats(Device::cuda(0));
    assert_eq!(
        (
            s.eager_capture_failed,
            s.eager_not_capturable,
            s.entries,
            s.instantiations
        ),
        (1, 1, 0, 0)
    );
    // The key is not stuck as pending: another capturable key works.
    assert_eq!(
        run(&c, &key(0, 2, &[0x200]), stream(0), 1),
        Outcome::Captured
    );
}

#[test]
fn forced_hash_collisions_never_replay_another_keys_graph() {
    // bucket_mask 0 puts every key in one bucket: only the full key
    // comparison tells them apart.
    for policy in [Policy::Recapture, Policy::ExecUpdate] {
        let c = cache(CacheConfig {
            bucket_mask: 0,
            policy,
            variants_per_topology: 2,
            ..CacheConfig::default()
        });
        let keys = [
            key(0, 1, &[0x1000]),
            key(0, 1, &[0x2000]),
            key(0, 2, &[0x1000]),
            CallKey {
                attributes: 0xb00.into(),
                ..key(0, 1, &[0x1000])
            },
            key(1, 1, &[0x1000]),
            key(0, 1, &[0x1000, 0x2000]),
        ];
        let mut want = std::collections::HashMap::new();
        for round in 0..3 {
            for (i, k) in keys.iter().enumerate() {
                let value = 1 + 10 * i as i64;
                let outcome = run(&c, k, stream(k.device.ordinal), value);
                if round > 0 {
                    assert_eq!(
                        outcome,
                        Outcome::Replayed,
                        "{policy:?} key {i} round {round}"
                    );
                }
                for b in &k.buffers {
                    *want.entry((k.device, b.address)).or_insert(0) += value;
                }
            }
        }
        for ((device, address), v) in want {
            assert_eq!(
                c.backend().read(device, address),
                v,
                "{policy:?} {device} {address:#x}"
            );
        }
        assert_eq!(c.stats(Device::cuda(0)).entries, 5, "{policy:?}");
    }
}

#[test]
fn forced_digest_collisions_never_replay_another_attributes_graph() {
    // Two attribute sets with one digest (as two XLA calls whose
    // attributes collide would have), the same op and buffers: only the
    // full comparison of the attributes tells them apart.
    for policy in [Policy::Recapture, Policy::ExecUpdate] {
        let c = cache(CacheConfig {
            policy,
            ..CacheConfig::default()
        });
        let sets = [
            Attributes::with_digest(
                0xd1,
                Attributes::named_ints(&[("align", 1)]).bytes().unwrap(),
            ),
            Attributes::with_digest(
                0xd1,
                Attributes::named_ints(&[("align", 2)]).bytes().unwrap(),
            ),
        ];
        let mut want = 0;
        for round in 0..2 {
            for (i, attributes) in sets.iter().enumerate() {
                let value = 1 + 10 * i as i64;
                let call = OpCall {
                    device: Device::cuda(0),
                    op: op_id("xcall_permute"),
                    attributes: attributes.clone(),
                    buffers: vec![Buffer::new(0x1000, 64, BufferRole::InOut)],
                    stream: Some(stream(0)),
                };
                let outcome = c
                    .run_op(call, |s| {
                        c.backend().enqueue(s.unwrap(), add(0x1000, value));
                        Ok::<(), std::io::Error>(())
                    })
                    .unwrap_or_else(|_| panic!("{policy:?} set {i}"));
                let expected = if round == 0 {
                    Outcome::Captured
                } else {
                    Outcome::Replayed
                };
                assert_eq!(outcome, expected, "{policy:?} set {i} round {round}");
                want += value;
            }
        }
        assert_eq!(
            c.backend().read(Device::cuda(0), 0x1000),
            want,
            "{policy:?}"
        );
        assert_eq!(c.stats(Device::cuda(0)).entries, 2, "{policy:?}");
    }
}

#[test]
fn the_record_function_runs_without_the_shard_lock() {
    // While a capture's record function runs, another thread can use the
    // same device's shard: the lock is not held across the caller's code.
    let c = Arc::new(cache(CacheConfig::default()));
    let k = key(0, 1, &[0x100]);
    let outcome = within("capture", watchdog(), {
        let c = c.clone();
        move || {
            let call = Call::new(k, Some(stream(0)));
            c.execute(&call, |s| {
                let other = c.clone();
                within("stats() during a record function", watchdog(), move || {
                    other.stats(Device::cuda(0))
                });
                c.backend().enqueue(s.unwrap(), add(0x100, 1));
                Ok::<(), std::io::Error>(())
            })
            .unwrap()
        }
    });
    assert_eq!(outcome, Outcome::Captured);
    assert_eq!(c.backend().read(Device::cuda(0), 0x100), 1);
}

#[test]
fn clear_all_counts_every_device_and_nodes_add_up() {
    let c = cache(CacheConfig::default());
    run_ops(&c, &key(0, 1, &[0x100]), stream(0), &[add(0x100, 1)]);
    run_ops(
        &c,
        &key(0, 2, &[0x200]),
        stream(0),
        &[add(0x200, 1), add(0x200, 2), add(0x200, 3)],
    );
    run_ops(
        &c,
        &key(1, 1, &[0x100]),
        stream(1),
        &[add(0x100, 1), add(0x100, 1)],
    );
    assert_eq!(
        (
            c.stats(Device::cuda(0)).nodes,
            c.stats(Device::cuda(1)).nodes
        ),
        (4, 2)
    );
    assert_eq!(c.clear_all(), 3);
    for d in [0, 1] {
        let s = c.stats(Device::cuda(d));
        assert_eq!((s.entries, s.nodes), (0, 0), "cuda:{d}");
    }
    assert_eq!(c.stats(Device::cuda(0)).invalidations, 2);
    assert_eq!(c.clear_all(), 0);
}

#[test]
fn graphs_exactly_at_the_node_limit_are_kept() {
    let config = CacheConfig {
        max_nodes: Some(4),
        ..CacheConfig::default()
    };
    let c = cache(config);
    assert_eq!(c.config(), &config);
    run(&c, &key(0, 1, &[0x100, 0x200]), stream(0), 1);
    run(&c, &key(0, 2, &[0x300, 0x400]), stream(0), 1);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.entries, s.nodes, s.evictions), (2, 4, 0));
}

#[test]
fn not_capturable_marks_are_bounded_like_the_cache() {
    let c = cache(CacheConfig {
        capacity: 2,
        retry_after: 5,
        ..CacheConfig::default()
    });
    let keys: Vec<CallKey> = (1..=3).map(|t| key(0, t, &[0x100 * t])).collect();
    for k in &keys {
        let ops = [SimOp::Uncapturable, add(k.buffers[0].address, 1)];
        assert_eq!(run_ops(&c, k, stream(0), &ops), Outcome::EagerFallback);
    }
    // Two marks are remembered (capacity 2): those keys still run eagerly;
    // the forgotten one captures at once.
    let outcomes: Vec<Outcome> = keys.iter().map(|k| run(&c, k, stream(0), 1)).collect();
    let eager = outcomes
        .iter()
        .filter(|o| **o == Outcome::EagerFallback)
        .count();
    assert_eq!(eager, 2, "{outcomes:?}");
    assert_eq!(c.stats(Device::cuda(0)).eager_not_capturable, 2);
}

#[test]
fn invalidate_range_forgets_the_not_capturable_marks_in_it_only() {
    let c = cache(CacheConfig {
        retry_after: 5,
        ..CacheConfig::default()
    });
    let inside = key(0, 1, &[0x1000]);
    let outside = key(0, 2, &[0x8000]);
    for k in [&inside, &outside] {
        let ops = [SimOp::Uncapturable, add(k.buffers[0].address, 1)];
        run_ops(&c, k, stream(0), &ops);
    }
    assert_eq!(
        c.invalidate_range(Device::cuda(0), 0x1000, 0x40).unwrap(),
        0
    );
    // The freed range's key may be new memory now: it captures again.
    assert_eq!(run(&c, &inside, stream(0), 1), Outcome::Captured);
    assert_eq!(run(&c, &outside, stream(0), 1), Outcome::EagerFallback);
}

#[test]
fn an_invalidated_capture_never_updates_a_cached_graph() {
    // `kept` is cached; `freed` has the same topology (an exec-update
    // candidate), but its memory is invalidated while it is captured.
    let c = Arc::new(cache(CacheConfig::default()));
    let kept = key(0, 1, &[0x100]);
    let freed = key(0, 1, &[0x200]);
    assert_eq!(run(&c, &kept, stream(0), 1), Outcome::Captured);
    // A lock held across the record function would deadlock here.
    let outcome = within("invalidate inside a record function", watchdog(), {
        let c = c.clone();
        move || {
            let call = Call::new(freed, Some(stream(0)));
            c.execute(&call, |s| {
                c.backend().enqueue(s.unwrap(), add(0x200, 1));
                c.invalidate_range(Device::cuda(0), 0x200, 1).map(|_| ())
            })
            .unwrap()
        }
    });
    assert_eq!(outcome, Outcome::Captured, "ran once, not cached");
    // The cached graph still serves `kept`; `freed` captures afresh.
    assert_eq!(run(&c, &kept, stream(0), 1), Outcome::Replayed);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.updates, s.entries, s.nodes), (0, 1, 1));
    // A real pointer change updates in place, and the node count stays the
    // graph's own.
    let moved = key(0, 1, &[0x300, 0x400]);
    let wide = key(0, 1, &[0x500, 0x600]);
    assert_eq!(run(&c, &moved, stream(0), 1), Outcome::Captured);
    assert_eq!(run(&c, &wide, stream(0), 1), Outcome::Updated);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.updates, s.entries, s.nodes), (1, 2, 3));
}

#[test]
fn concurrent_captures_of_two_keys_keep_their_own_pending_state() {
    // A's capture waits inside its record function while B, another key on
    // another stream of the same device and context, captures: B must capture (not run eagerly
    // as if A's capture were its own), and the invalidation of A's memory
    // must keep A's graph, and only A's, out of the cache.
    use std::sync::mpsc;
    let c = Arc::new(cache(CacheConfig::default()));
    let a = key(0, 1, &[0x1000]);
    let b = key(0, 2, &[0x2000]);
    let (started_tx, started) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let capture_a = {
        let (c, a) = (c.clone(), a.clone());
        std::thread::spawn(move || {
            let call = Call::new(a, Some(stream(0)));
            c.execute(&call, |s| {
                c.backend().enqueue(s.unwrap(), add(0x1000, 1));
                started_tx.send(()).unwrap();
                go_rx
                    .recv_timeout(watchdog())
                    .map_err(|_| std::io::Error::other("the test never released capture A"))
            })
        })
    };
    started
        .recv_timeout(watchdog())
        .expect("capture A never started");
    c.invalidate_range(Device::cuda(0), 0x1000, 1).unwrap();
    let second = SimStream { id: 2, ..stream(0) };
    assert_eq!(run(&c, &b, second, 1), Outcome::Captured);
    go.send(()).unwrap();
    let outcome_a = within("capture A", watchdog(), move || capture_a.join().unwrap()).unwrap();
    assert_eq!(outcome_a, Outcome::Captured);
    let s = c.stats(Device::cuda(0));
    assert_eq!((s.entries, s.eager_capture_in_progress), (1, 0));
    assert_eq!(run(&c, &b, second, 1), Outcome::Replayed);
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
}

/// An op's error type for `execute_op`: not boxable into the cache's error
/// without losing its code.
#[derive(Debug, PartialEq, Eq)]
struct OpCode(u32);

impl std::fmt::Display for OpCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "op code {}", self.0)
    }
}

#[test]
fn execute_op_returns_the_ops_own_error_whole() {
    use xcall_graph::OpFailure;
    let c = cache(CacheConfig::default());
    // Fails under capture (code 1) and eagerly (code 2): the last error.
    let mut code = 0;
    let err = c
        .execute_op(&Call::new(key(0, 1, &[0x100]), Some(stream(0))), |_| {
            code += 1;
            Err(OpCode(code))
        })
        .unwrap_err();
    assert!(matches!(err, OpFailure::Op(OpCode(2))), "{err:?}");
    // Fails under capture only: the eager run's success counts.
    let mut first = true;
    let outcome = c.execute_op(&Call::new(key(0, 2, &[0x200]), Some(stream(0))), |s| {
        if std::mem::take(&mut first) {
            return Err(OpCode(7));
        }
        c.backend().enqueue(s.unwrap(), add(0x200, 1));
        Ok(())
    });
    assert_eq!(outcome.unwrap(), Outcome::EagerFallback);
    assert_eq!(c.backend().read(Device::cuda(0), 0x200), 1);
    // A refusal of the cache itself (no stream on CUDA) never reaches the op.
    let err = c
        .execute_op(&Call::new(key(0, 3, &[0x300]), None), |_| Err(OpCode(9)))
        .unwrap_err();
    match err {
        OpFailure::Cache(e) => assert_eq!(e.status(), xcall_core::Status::InvalidArgument),
        other => panic!("expected the cache's refusal, got {other:?}"),
    }
    // Success passes the outcome through.
    let outcome = c.execute_op(&Call::new(key(0, 4, &[0x400]), Some(stream(0))), |s| {
        c.backend().enqueue(s.unwrap(), add(0x400, 3));
        Ok::<(), OpCode>(())
    });
    assert_eq!(outcome.unwrap(), Outcome::Captured);
}

/// Runs a relocatable call of `key` on `s`; the record function (counted in
/// `records`) enqueues `ops(key)`.
fn run_relocatable(
    c: &GraphCache<SimBackend>,
    key: &CallKey,
    records: &mut u32,
    ops: impl Fn(&CallKey) -> Vec<SimOp>,
) -> Outcome {
    let call = Call::new(key.clone(), Some(stream(0))).relocatable();
    c.execute(&call, |stream| {
        *records += 1;
        for op in ops(key) {
            c.backend().enqueue(stream.unwrap(), op);
        }
        Ok::<(), std::io::Error>(())
    })
    .unwrap()
}

#[test]
fn relocatable_calls_move_the_pointers_of_a_cached_graph_without_capture() {
    let c = cache(CacheConfig::default());
    let mut records = 0;
    // Each buffer's first cell, and a scratch cell no buffer holds (a
    // pointer the op owns, which must stay where it is).
    let ops = |k: &CallKey| {
        let mut v: Vec<SimOp> = k.buffers.iter().map(|b| add(b.address + 8, 1)).collect();
        v.push(add(0x9_0000, 10));
        v
    };
    let a = key(0, 1, &[0x1000, 0x2000]);
    let b = key(0, 1, &[0x5000, 0x6100]);
    assert_eq!(
        run_relocatable(&c, &a, &mut records, ops),
        Outcome::Captured
    );
    assert_eq!(run_relocatable(&c, &b, &mut records, ops), Outcome::Patched);
    assert_eq!(records, 1, "a patch runs no record function");
    let read = |addr| c.backend().read(Device::cuda(0), addr);
    // The new buffers were written, the old ones only by the first call,
    // the scratch cell by both.
    assert_eq!((read(0x5008), read(0x6108)), (1, 1));
    assert_eq!((read(0x1008), read(0x2008)), (1, 1));
    assert_eq!(read(0x9_0000), 20);
    // The patched executable is cached under the new key, and patches back.
    assert_eq!(
        run_relocatable(&c, &b, &mut records, ops),
        Outcome::Replayed
    );
    assert_eq!(run_relocatable(&c, &a, &mut records, ops), Outcome::Patched);
    assert_eq!((read(0x1008), read(0x5008)), (2, 2));
    let s = c.stats(Device::cuda(0));
    assert_eq!(
        (
            s.captures,
            s.instantiations,
            s.patches,
            s.updates,
            s.hits,
            s.entries
        ),
        (1, 1, 2, 0, 1, 1)
    );
}

#[test]
fn calls_a_pointer_move_cannot_express_take_the_capture_path() {
    let ops = |k: &CallKey| vec![add(k.buffers[0].address, 1), add(k.buffers[1].address, 1)];
    let a = key(0, 1, &[0x1000, 0x2000]);
    for (why, new) in [
        ("alignment below 256 changes", key(0, 1, &[0x5010, 0x6000])),
        ("the buffers now overlap", key(0, 1, &[0x5000, 0x5000])),
    ] {
        let c = cache(CacheConfig::default());
        let mut records = 0;
        assert_eq!(
            run_relocatable(&c, &a, &mut records, ops),
            Outcome::Captured
        );
        assert_eq!(
            run_relocatable(&c, &new, &mut records, ops),
            Outcome::Updated,
            "{why}"
        );
        assert_eq!((records, c.stats(Device::cuda(0)).patches), (2, 0), "{why}");
        // After an update the executable runs the new graph's parameters:
        // it is no longer patched, only updated.
        assert_eq!(run_relocatable(&c, &a, &mut records, ops), Outcome::Updated);
    }
    // A graph with a node the backend cannot patch (a foreign kernel).
    let c = cache(CacheConfig::default());
    let mut records = 0;
    let foreign = |k: &CallKey| {
        vec![SimOp::Foreign {
            address: k.buffers[0].address,
            value: 1,
        }]
    };
    assert_eq!(
        run_relocatable(&c, &a, &mut records, foreign),
        Outcome::Captured
    );
    let b = key(0, 1, &[0x5000, 0x6000]);
    assert_eq!(
        run_relocatable(&c, &b, &mut records, foreign),
        Outcome::Updated
    );
    assert_eq!(c.backend().read(Device::cuda(0), 0x5000), 1);
    // Calls not declared relocatable, and the Recapture policy, never patch.
    let c = cache(CacheConfig::default());
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
    assert_eq!(run(&c, &b, stream(0), 1), Outcome::Updated);
    // Nor does a graph a non-relocatable call captured, when a relocatable
    // call of its topology comes.
    let c = cache(CacheConfig::default());
    let mut records = 0;
    assert_eq!(run(&c, &a, stream(0), 1), Outcome::Captured);
    assert_eq!(run_relocatable(&c, &b, &mut records, ops), Outcome::Updated);
    let c = cache(CacheConfig {
        policy: Policy::Recapture,
        ..CacheConfig::default()
    });
    let mut records = 0;
    assert_eq!(
        run_relocatable(&c, &a, &mut records, ops),
        Outcome::Captured
    );
    assert_eq!(
        run_relocatable(&c, &b, &mut records, ops),
        Outcome::Captured
    );
}
