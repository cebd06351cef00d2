//! Launch configs: what a tunable kernel's launch may vary, the
//! candidates the tuner tries for each kernel, and the kernel of the
//! catalogue each config launches.

use xcall_core::Device;

use super::catalogue::{Lanes, ASYNC_STAGES, BULK_STAGES, HELD, UNROLLS};
use super::{device_facts, Result};

/// A launch config of a tunable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Threads per block.
    pub threads: u32,
    /// Vectors in flight per thread (movement, unpermute), or dot slots per
    /// thread (`unpermute_backward`: threads = 256 / slots).
    pub unroll: u32,
    /// Blocks per multiprocessor, each looping over rows; 0 for one block
    /// (or warp) per row, or, for the bulk-copy kernels, as many blocks as
    /// fit the multiprocessors at once.
    pub waves: u32,
    /// Each warp takes its own row (the `*_w_*` kernels) instead of the
    /// whole block taking one.
    pub per_warp: bool,
    /// `unpermute_backward` only: 16-byte groups of the token's gradient
    /// each of the block's 256 threads holds in registers for all of the
    /// token's routes (the `unpermute_bwd_h*` kernels, rows of at most
    /// 256 x `held` whole groups; `unroll` routes per batch); 0 otherwise.
    pub held: u32,
    /// `permute`: shared-memory stages of the bulk-copy kernel
    /// (`permute_bulk_S`: sm_90 or newer, rows and addresses in 16-byte
    /// units, pieces of [`bulk_piece`] bytes). `unpermute`: stages of the
    /// async kernel (`unpermute_aS_w_16_1`: a warp per token, 16-byte
    /// vectors, [`async_smem`] bytes of shared memory). 0 for the other
    /// kernels.
    pub stages: u32,
    /// `unpermute_backward`'s warp kernel only: warps that share a token,
    /// its routes dealt out among them (`T x split` warps' worth of work
    /// where few tokens would leave warp slots idle); 0 for one warp per
    /// token and for the other kernels.
    pub split: u32,
}

impl LaunchConfig {
    /// Rows one block takes at a time.
    fn rows_per_block(self) -> u64 {
        if self.per_warp {
            (self.threads / 32).max(1) as u64
        } else {
            1
        }
    }

    /// How the config's movement or summing kernel lays threads over rows
    /// of `width`-byte vectors.
    pub(super) fn lanes(self, width: usize) -> Lanes {
        Lanes {
            width,
            unroll: self.unroll,
            warp: self.per_warp,
        }
    }
}

pub(super) fn default_config(vectors_per_row: u64) -> LaunchConfig {
    let threads = (vectors_per_row.div_ceil(2))
        .next_power_of_two()
        .clamp(64, 256) as u32;
    LaunchConfig {
        threads,
        unroll: 2,
        waves: 0,
        per_warp: false,
        held: 0,
        stages: 0,
        split: 0,
    }
}

/// The configs tried for unpermute and sort_chunks_by_map, and permute's
/// register kernels (see [`permute_candidates`]).
#[doc(hidden)]
pub fn movement_candidates() -> Vec<LaunchConfig> {
    let mut c = Vec::new();
    for per_warp in [false, true] {
        for threads in [128, 256, 512] {
            for unroll in UNROLLS {
                for waves in [0, 4, 8] {
                    c.push(LaunchConfig {
                        threads,
                        unroll,
                        waves,
                        per_warp,
                        held: 0,
                        stages: 0,
                        split: 0,
                    });
                }
            }
        }
    }
    c
}

/// Routes whose vectors one stage of an async unpermute warp holds (the
/// kernels' `ASYNC_ROUTES`).
const ASYNC_ROUTES: u64 = 8;

/// The dynamic shared memory of an async unpermute block of `threads`
/// threads with `stages` stages: per warp, `stages` x [`ASYNC_ROUTES`] x 32
/// vectors of 16 bytes.
pub(super) fn async_smem(threads: u32, stages: u32) -> u64 {
    (threads / 32) as u64 * stages as u64 * ASYNC_ROUTES * 32 * 16
}

/// The configs tried for unpermute: the movement configs and, where rows
/// and addresses are whole 16-byte vectors (`async_rows`), the async
/// kernels' (a warp per token; blocks of 64 or 128 threads whose stages
/// fit [`BULK_SMEM`]).
#[doc(hidden)]
pub fn unpermute_candidates(async_rows: bool) -> Vec<LaunchConfig> {
    let mut c = movement_candidates();
    if !async_rows {
        return c;
    }
    for threads in [64, 128] {
        for stages in ASYNC_STAGES {
            if async_smem(threads, stages) > BULK_SMEM {
                continue;
            }
            for waves in [0, 8] {
                c.push(LaunchConfig {
                    threads,
                    unroll: 1,
                    waves,
                    per_warp: true,
                    held: 0,
                    stages,
                    split: 0,
                });
            }
        }
    }
    c
}

/// Shared memory the stages of a bulk-copy permute block take at most
/// (bytes): with the kernel's own arrays and the zero fill's, under the
/// 48 KiB a kernel may use without opting in.
pub(super) const BULK_SMEM: u64 = 40 * 1024;

/// Threads of a bulk-copy permute block: the mover's warp and the
/// router's.
pub(super) const BULK_THREADS: u32 = 64;

/// The bytes one bulk copy of a `row`-byte row moves with `stages` stages:
/// the row in as few pieces as keep the stages within [`BULK_SMEM`], each a
/// multiple of 16 bytes (the last piece may be shorter). `row` is a
/// positive multiple of 16 and `stages` one of [`BULK_STAGES`].
pub(super) fn bulk_piece(row: u64, stages: u32) -> u64 {
    let pieces = (row * stages as u64).div_ceil(BULK_SMEM).max(1);
    row.div_ceil(pieces).next_multiple_of(16)
}

/// The configs tried for permute: the movement kernels' and, where the
/// device and the row take them, the bulk-copy kernels' (a block of two
/// warps; `waves` blocks per multiprocessor, 0: as many as fit).
#[doc(hidden)]
pub fn permute_candidates() -> Vec<LaunchConfig> {
    let mut c = movement_candidates();
    for stages in BULK_STAGES {
        for waves in [0, 4, 8, 16] {
            c.push(LaunchConfig {
                threads: BULK_THREADS,
                unroll: 1,
                waves,
                per_warp: false,
                held: 0,
                stages,
                split: 0,
            });
        }
    }
    c
}

/// The configs tried for unpermute_backward: a block of 256 / slots
/// threads per token, a warp per token holding all 256 dot slots, or 2, 4
/// or 8 such warps per token sharing its routes.
#[doc(hidden)]
pub fn backward_candidates() -> Vec<LaunchConfig> {
    let mut c = Vec::new();
    for waves in [0, 4, 8] {
        for unroll in UNROLLS {
            c.push(LaunchConfig {
                threads: 256 / unroll,
                unroll,
                waves,
                per_warp: false,
                held: 0,
                stages: 0,
                split: 0,
            });
        }
        for threads in [128, 256] {
            for split in [0, 2, 4, 8] {
                if split > 0 && waves == 4 {
                    continue;
                }
                c.push(LaunchConfig {
                    threads,
                    unroll: 8,
                    waves,
                    per_warp: true,
                    held: 0,
                    stages: 0,
                    split,
                });
            }
        }
    }
    for (held, unroll) in HELD {
        c.push(LaunchConfig {
            threads: 256,
            unroll,
            waves: 0,
            per_warp: false,
            held,
            stages: 0,
            split: 0,
        });
    }
    c
}

/// Whether a row-holding `unpermute_backward` config fits rows of `row`
/// bytes moved in `width`-byte vectors: whole 16-byte groups, at most 256
/// x `held` of them.
pub(super) fn held_fits(config: LaunchConfig, width: usize, row: u64) -> bool {
    width == 16 && row % 16 == 0 && row / 16 <= 256 * config.held as u64
}

/// Blocks for `rows` rows under `config`.
pub(super) fn grid_for(device: Device, rows: usize, config: LaunchConfig) -> Result<u64> {
    let rows = (rows as u64).div_ceil(config.rows_per_block()).min(1 << 20);
    if config.waves == 0 {
        return Ok(rows);
    }
    let sms = device_facts(device)?.multiprocessors;
    Ok(rows.min(sms * config.waves as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_pieces_keep_the_stages_within_their_shared_memory() {
        // Known answers: a 14 KiB row in 2 pieces at 4 stages, in 3 at 8
        // (4779 bytes rounded up to 4784; the last piece 4768); a row
        // that fits whole stays whole.
        assert_eq!(bulk_piece(14336, 4), 7168);
        assert_eq!(bulk_piece(14336, 8), 4784);
        assert_eq!(bulk_piece(4096, 8), 4096);
        assert_eq!(bulk_piece(16, 8), 16);
        for row in (16..=65536).step_by(16 * 37) {
            for stages in BULK_STAGES {
                let piece = bulk_piece(row, stages);
                assert_eq!(piece % 16, 0, "row {row}, {stages} stages");
                assert!(piece <= row && piece > 0, "row {row}: piece {piece}");
                assert!(
                    stages as u64 * piece <= BULK_SMEM + 16 * stages as u64,
                    "row {row}, {stages} stages: {piece}-byte pieces"
                );
                // The pieces cover the row with no empty last piece.
                let pieces = row.div_ceil(piece);
                assert!((pieces - 1) * piece < row, "row {row}: piece {piece}");
            }
        }
    }

    #[test]
    fn permute_tries_the_movement_configs_and_each_bulk_copy_grid() {
        let (moves, all) = (movement_candidates(), permute_candidates());
        assert_eq!(&all[..moves.len()], &moves[..]);
        let bulk: Vec<(u32, u32)> = all[moves.len()..]
            .iter()
            .inspect(|c| assert_eq!((c.threads, c.per_warp, c.held), (BULK_THREADS, false, 0)))
            .map(|c| (c.stages, c.waves))
            .collect();
        let want: Vec<(u32, u32)> = BULK_STAGES
            .iter()
            .flat_map(|&s| [0, 4, 8, 16].map(|w| (s, w)))
            .collect();
        assert_eq!(bulk, want);
        assert!(moves.iter().all(|c| c.stages == 0));
    }

    #[test]
    fn unpermute_tries_async_configs_only_where_rows_take_them_and_each_fits() {
        let moves = movement_candidates();
        assert_eq!(unpermute_candidates(false), moves);
        let all = unpermute_candidates(true);
        assert_eq!(&all[..moves.len()], &moves[..]);
        let extra: Vec<(u32, u32, u32)> = all[moves.len()..]
            .iter()
            .inspect(|c| assert_eq!((c.unroll, c.per_warp, c.held, c.split), (1, true, 0, 0)))
            .map(|c| (c.threads, c.stages, c.waves))
            .collect();
        // 64 threads: 16 and 24 KiB of stages; 128 threads: 32 KiB at two
        // stages, 48 KiB at three (over the limit, left out).
        let want = [(64, 2), (64, 3), (128, 2)];
        let want: Vec<(u32, u32, u32)> = want
            .iter()
            .flat_map(|&(t, s)| [0, 8].map(|w| (t, s, w)))
            .collect();
        assert_eq!(extra, want);
        assert_eq!(async_smem(64, 3), 24 * 1024);
        assert_eq!(async_smem(128, 2), 32 * 1024);
        assert_eq!(async_smem(128, 3), 48 * 1024);
    }

    #[test]
    fn a_warp_per_row_config_takes_threads_over_32_rows_per_block() {
        let c = |threads, per_warp| LaunchConfig {
            threads,
            unroll: 1,
            waves: 0,
            per_warp,
            held: 0,
            stages: 0,
            split: 0,
        };
        assert_eq!(c(256, true).rows_per_block(), 8);
        assert_eq!(c(256, false).rows_per_block(), 1);
        assert_eq!(
            c(256, true).lanes(8),
            Lanes {
                width: 8,
                unroll: 1,
                warp: true
            }
        );
        assert!(!c(256, false).lanes(16).warp);
        // No device is asked for the SM count with waves 0.
        assert_eq!(grid_for(Device::cuda(7), 1001, c(128, true)).unwrap(), 251);
        assert_eq!(
            grid_for(Device::cuda(7), 1001, c(128, false)).unwrap(),
            1001
        );
    }

    #[test]
    fn backward_candidates_keep_256_dot_slots_per_token() {
        let c = backward_candidates();
        assert_eq!(c.len(), 30);
        for k in &c {
            if k.per_warp {
                assert_eq!(k.unroll, 8, "{k:?}");
                assert!(k.threads <= 256 && k.threads % 32 == 0, "{k:?}");
                assert!([0, 2, 4, 8].contains(&k.split), "{k:?}");
            } else if k.held > 0 {
                // One dot slot per thread; `unroll` routes per batch.
                assert_eq!((k.threads, k.waves), (256, 0), "{k:?}");
                assert!(HELD.contains(&(k.held, k.unroll)), "{k:?}");
            } else {
                assert_eq!(k.threads * k.unroll, 256, "{k:?}");
            }
            if !k.per_warp {
                assert_eq!(k.split, 0, "{k:?}");
            }
        }
        // Each split in blocks of 4 and 8 warps, with a warp for each share
        // of a token (waves 0) and with 8 blocks per multiprocessor.
        for split in [2, 4, 8] {
            let n = c.iter().filter(|k| k.split == split).count();
            assert_eq!(n, 4, "split {split}");
        }
        assert_eq!(movement_candidates().len(), 54);
    }

    #[test]
    fn a_held_row_is_whole_16_byte_groups_at_most_256_per_held() {
        let c = |held| LaunchConfig {
            threads: 256,
            unroll: 1,
            waves: 0,
            per_warp: false,
            held,
            stages: 0,
            split: 0,
        };
        // 256 x 4 groups of 16 bytes: 16384 bytes.
        assert!(held_fits(c(4), 16, 16384));
        assert!(!held_fits(c(4), 16, 16384 + 16));
        assert!(held_fits(c(8), 16, 16384 + 16));
        assert!(held_fits(c(8), 16, 32768));
        assert!(!held_fits(c(8), 16, 32768 + 16));
        assert!(held_fits(c(4), 16, 16));
        // Vectors narrower than 16 bytes (an unaligned address), or a row
        // with a partial group, are not held.
        assert!(!held_fits(c(4), 8, 1024));
        assert!(!held_fits(c(4), 16, 1000));
    }
}
