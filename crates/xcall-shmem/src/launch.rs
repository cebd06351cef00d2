//! Ranks from the launchers people use, with no flags.
//!
//! [`LaunchEnv::from_env`] reads what a launcher exports to each process:
//!
//! | launcher | rank, size | on this host | rank 0's address |
//! |---|---|---|---|
//! | torchrun | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `MASTER_ADDR`, `MASTER_PORT` |
//! | Open MPI's `mpirun` | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | `MASTER_ADDR`, `MASTER_PORT` (set them) |
//! | Slurm's `srun` | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID` | `MASTER_ADDR`, `MASTER_PORT` (set them) |
//!
//! The first launcher whose rank and size are both set wins, in that
//! order. Every value is checked: numbers that do not parse, a rank
//! outside its size, a port outside 1..65535, or a size past
//! [`crate::MAX_PES`] are errors naming the variable; so is a second
//! launcher's rank that disagrees with the first's (a torchrun inside an
//! `srun` allocation exports both, which must agree when both are ranks
//! of this world). [`LaunchEnv::config`] makes the TCP bootstrap's
//! [`WorldConfig`] for one PE per process.

use xcall_core::Device;

use crate::error::{Result, ShmemError};
use crate::world::{WorldConfig, MAX_PES};

/// What a launcher told this process: its environment, read once (not a
/// kernel launch, which is `xcall_core::cuda::Launch`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher that set the variables: "torchrun", "mpirun" or "srun".
    pub launcher: &'static str,
    /// This process's rank among `size`.
    pub rank: usize,
    /// Processes in the job.
    pub size: usize,
    /// This process's rank among the job's processes on this host, where
    /// the launcher says.
    pub local_rank: Option<usize>,
    /// The job's processes on this host, where the launcher says.
    pub local_size: Option<usize>,
    /// Rank 0's `host:port` (`MASTER_ADDR`, `MASTER_PORT`), when set.
    pub address: Option<String>,
}

/// (name, rank, size, local rank, local size) of each launcher, in the
/// order they are tried.
const LAUNCHERS: [(&str, &str, &str, &str, Option<&str>); 3] = [
    (
        "torchrun",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        Some("LOCAL_WORLD_SIZE"),
    ),
    (
        "mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    ),
    (
        "srun",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        None,
    ),
];

fn number(var: &str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| {
        ShmemError::InvalidArgument(format!("{var}={value:?} is not a non-negative integer"))
    })
}

impl LaunchEnv {
    /// The launcher's variables of this process; `Ok(None)` when no
    /// launcher set its rank and size.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`LaunchEnv::from_env`], reading variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let mut found: Option<LaunchEnv> = None;
        for (launcher, rank_var, size_var, local_var, local_size_var) in LAUNCHERS {
            let (Some(rank), Some(size)) = (var(rank_var), var(size_var)) else {
                continue;
            };
            let (rank, size) = (number(rank_var, &rank)?, number(size_var, &size)?);
            if size == 0 || rank >= size {
                return Err(ShmemError::InvalidArgument(format!(
                    "{rank_var}={rank} is not a rank of {size_var}={size}"
                )));
            }
            if size > MAX_PES {
                return Err(ShmemError::InvalidArgument(format!(
                    "{size_var}={size} is larger than the limit of {MAX_PES} PEs"
                )));
            }
            if let Some(first) = &found {
                if (first.rank, first.size) != (rank, size) {
                    return Err(ShmemError::Mismatch(format!(
                        "{} says rank {} of {}, but {rank_var}={rank} and {size_var}={size} ({launcher}) disagree",
                        first.launcher, first.rank, first.size
                    )));
                }
                continue;
            }
            let local_rank = var(local_var).map(|v| number(local_var, &v)).transpose()?;
            let local_size = match local_size_var {
                Some(name) => var(name).map(|v| number(name, &v)).transpose()?,
                None => None,
            };
            if let (Some(r), Some(n)) = (local_rank, local_size) {
                if r >= n || n > size {
                    return Err(ShmemError::InvalidArgument(format!(
                        "{local_var}={r} is not a local rank of {n} processes in a job of {size}"
                    )));
                }
            }
            found = Some(LaunchEnv {
                launcher,
                rank,
                size,
                local_rank,
                local_size,
                address: None,
            });
        }
        let Some(mut launch) = found else {
            return Ok(None);
        };
        launch.address = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(host), Some(port)) => {
                let p = number("MASTER_PORT", &port)?;
                if p == 0 || p > 65535 {
                    return Err(ShmemError::InvalidArgument(format!(
                        "MASTER_PORT={p} is not a TCP port (1..65535)"
                    )));
                }
                let host = host.trim();
                if host.is_empty() {
                    return Err(ShmemError::InvalidArgument("MASTER_ADDR is empty".into()));
                }
                // An IPv6 literal takes brackets in host:port.
                Some(if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{p}")
                } else {
                    format!("{host}:{p}")
                })
            }
            (None, None) => None,
            (Some(_), None) => {
                return Err(ShmemError::InvalidArgument(
                    "MASTER_ADDR is set but MASTER_PORT is not".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(ShmemError::InvalidArgument(
                    "MASTER_PORT is set but MASTER_ADDR is not".into(),
                ))
            }
        };
        Ok(Some(launch))
    }

    /// The TCP bootstrap's config of this process as one PE on `device`
    /// (rank and size the launcher's). An error when the launcher gave no
    /// `MASTER_ADDR` and `MASTER_PORT`.
    pub fn config(&self, device: Device) -> Result<WorldConfig> {
        let address = self.address.as_deref().ok_or_else(|| {
            ShmemError::InvalidArgument(format!(
                "{} gave rank {} of {} but no rank 0 address: set MASTER_ADDR and MASTER_PORT",
                self.launcher, self.rank, self.size
            ))
        })?;
        Ok(WorldConfig::tcp(address, self.rank, self.size, device))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|name| map.get(name).cloned())
    }

    fn refused(vars: &[(&str, &str)], needle: &str) {
        let e = launch(vars).expect_err(&format!("{vars:?} accepted"));
        assert!(e.to_string().contains(needle), "{vars:?}: {e}");
    }

    #[test]
    fn each_launcher_is_read_with_its_local_ranks_and_address() {
        let torchrun = launch(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            torchrun,
            LaunchEnv {
                launcher: "torchrun",
                rank: 5,
                size: 8,
                local_rank: Some(1),
                local_size: Some(4),
                address: Some("node0:29500".into()),
            }
        );
        let mpirun = launch(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (mpirun.launcher, mpirun.rank, mpirun.size, mpirun.local_rank),
            ("mpirun", 2, 3, Some(0))
        );
        assert_eq!((mpirun.local_size, mpirun.address), (Some(1), None));
        let srun = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "fe80::1"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((srun.launcher, srun.rank, srun.size), ("srun", 0, 16));
        assert_eq!(srun.address.as_deref(), Some("[fe80::1]:1"));
        assert_eq!(
            launch(&[("RANK", "0")]).unwrap(),
            None,
            "no size: no launcher"
        );
        assert_eq!(launch(&[]).unwrap(), None);
    }

    #[test]
    fn a_second_launcher_must_agree_with_the_first() {
        let both = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
        ];
        assert_eq!(launch(&both).unwrap().unwrap().launcher, "torchrun");
        refused(
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
            ],
            "SLURM_PROCID=0 and SLURM_NTASKS=2 (srun) disagree",
        );
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        refused(&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\"");
        refused(&[("RANK", "-1"), ("WORLD_SIZE", "2")], "RANK=\"-1\"");
        refused(
            &[("RANK", "2"), ("WORLD_SIZE", "2")],
            "RANK=2 is not a rank of WORLD_SIZE=2",
        );
        refused(&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=0");
        let big = (MAX_PES + 1).to_string();
        refused(
            &[("RANK", "0"), ("WORLD_SIZE", &big)],
            "larger than the limit",
        );
        refused(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
            ],
            "LOCAL_RANK=2 is not a local rank of 2",
        );
        refused(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "3"),
            ],
            "in a job of 2",
        );
        let addr = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        refused(&addr, "MASTER_PORT is not");
        refused(
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
            "MASTER_ADDR is not",
        );
        for port in ["0", "65536", "p"] {
            let vars = [
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", port),
            ];
            refused(&vars, "MASTER_PORT");
        }
        let vars = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", " "),
            ("MASTER_PORT", "9"),
        ];
        refused(&vars, "MASTER_ADDR is empty");
    }

    #[test]
    fn the_largest_values_are_accepted() {
        let max = MAX_PES.to_string();
        let last = (MAX_PES - 1).to_string();
        let l = launch(&[
            ("RANK", &last),
            ("WORLD_SIZE", &max),
            ("LOCAL_RANK", &last),
            ("LOCAL_WORLD_SIZE", &max),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "65535"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.size), (MAX_PES - 1, MAX_PES));
        assert_eq!(
            (l.local_rank, l.local_size),
            (Some(MAX_PES - 1), Some(MAX_PES))
        );
        assert_eq!(l.address.as_deref(), Some("h:65535"));
    }

    #[test]
    fn a_config_needs_the_address() {
        let l = launch(&[("RANK", "1"), ("WORLD_SIZE", "2")])
            .unwrap()
            .unwrap();
        let e = l.config(Device::HOST).unwrap_err();
        assert!(
            e.to_string().contains("set MASTER_ADDR and MASTER_PORT"),
            "{e}"
        );
        let l = LaunchEnv {
            address: Some("127.0.0.1:7".into()),
            ..l
        };
        let c = l.config(Device::HOST).unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
        assert_eq!(
            c.bootstrap,
            crate::BootstrapKind::Tcp {
                address: "127.0.0.1:7".into()
            }
        );
    }
}
