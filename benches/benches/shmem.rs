//! Host symmetric memory with 2, 4 and 8 SPMT PEs (threads of this
//! process): put bandwidth, every PE putting to the next one at once
//! (throughput per PE), and `barrier_all` latency; next to a one-thread
//! `copy_from_slice` of the same bytes measured in the same run.
//!
//! The bench thread is PE 0; the other PEs are threads that run the same
//! rounds on command, so every timed round is collective. PE 0 times from
//! a barrier before its first round to a barrier after its last one.

use std::hint::black_box;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use xcall_core::{Device, Platform};
use xcall_shmem::{World, WorldConfig};

const SIZES: [usize; 2] = [64 << 10, 4 << 20];
const HEAP: usize = 24 << 20;

/// One collective job: `rounds` of it, then a barrier.
#[derive(Clone, Copy)]
enum Job {
    Barrier,
    Put { bytes: usize },
}

/// One PE's state: its world, a symmetric destination and a local source.
struct Pe {
    world: World,
    rank: usize,
    size: usize,
    dest: u64,
    src: Vec<u8>,
}

impl Pe {
    fn new(group: &str, rank: usize, size: usize) -> Pe {
        let mut world = World::new();
        let mut c =
            WorldConfig::in_process(group, rank, size, Device::new(Platform::Host, rank as u32));
        c.heap_bytes = Some(HEAP);
        c.timeout = Duration::from_secs(120);
        world.init(&c).expect("init");
        let max = SIZES.iter().copied().max().unwrap_or(0);
        let dest = world.malloc(max).expect("malloc");
        let src = (0..max).map(|i| (i * 7 + rank) as u8).collect();
        Pe {
            world,
            rank,
            size,
            dest,
            src,
        }
    }

    fn run(&mut self, job: Job, rounds: u64) {
        self.world.barrier_all().expect("barrier");
        for _ in 0..rounds {
            match job {
                Job::Barrier => self.world.barrier_all().expect("barrier"),
                Job::Put { bytes } => {
                    let next = (self.rank + 1) % self.size;
                    // SAFETY: `src` holds at least `bytes` readable bytes.
                    unsafe {
                        self.world
                            .put(self.dest, self.src.as_ptr() as u64, bytes, next)
                            .expect("put")
                    };
                }
            }
        }
        self.world.barrier_all().expect("barrier");
    }

    fn finish(mut self) {
        self.world.free(self.dest).expect("free");
        let report = self.world.finalize().expect("finalize");
        assert!(report.leaked.is_empty(), "leaked {:?}", report.leaked);
    }
}

/// PE 0 in this thread, the others on threads taking jobs from channels.
struct Team {
    pe0: Pe,
    jobs: Vec<mpsc::Sender<Option<(Job, u64)>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Team {
    fn new(size: usize) -> Team {
        let group = format!("bench-shmem-{size}");
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        for rank in 1..size {
            let (tx, rx) = mpsc::channel::<Option<(Job, u64)>>();
            let group = group.clone();
            threads.push(std::thread::spawn(move || {
                let mut pe = Pe::new(&group, rank, size);
                while let Ok(Some((job, rounds))) = rx.recv() {
                    pe.run(job, rounds);
                }
                pe.finish();
            }));
            jobs.push(tx);
        }
        Team {
            pe0: Pe::new(&group, 0, size),
            jobs,
            threads,
        }
    }

    /// Time of `rounds` rounds of `job` on every PE, as PE 0 sees it.
    fn time(&mut self, job: Job, rounds: u64) -> Duration {
        for tx in &self.jobs {
            tx.send(Some((job, rounds))).expect("PE thread alive");
        }
        let t0 = Instant::now();
        self.pe0.run(job, rounds);
        t0.elapsed()
    }

    fn finish(self) {
        for tx in &self.jobs {
            let _ = tx.send(None);
        }
        self.pe0.finish();
        for t in self.threads {
            t.join().expect("PE thread");
        }
    }
}

fn shmem(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut g = c.benchmark_group(format!("shmem_host_{threads}_hw_threads"));
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(300));
    for bytes in SIZES {
        let src = vec![3u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(BenchmarkId::new("copy_1_thread", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
    }
    for size in [2, 4, 8] {
        let mut team = Team::new(size);
        for bytes in SIZES {
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("put_ring_{size}_pes"), bytes),
                &bytes,
                |b, &bytes| b.iter_custom(|n| team.time(Job::Put { bytes }, n)),
            );
        }
        g.throughput(Throughput::Elements(1));
        g.bench_function(
            BenchmarkId::new("barrier_all", format!("{size}_pes")),
            |b| b.iter_custom(|n| team.time(Job::Barrier, n)),
        );
        team.finish();
    }
    g.finish();
}

criterion_group!(benches, shmem);
criterion_main!(benches);
