//! Every `XCALL_*` environment variable in one place: what each means,
//! who reads it, and one parser per kind, so that a boolean or a size is
//! spelled the same way everywhere. `docs/ENVIRONMENT.md` is
//! [`markdown_table`]'s output (a test keeps the two equal).
//!
//! - Booleans: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`
//!   (any case, surrounding spaces ignored); empty is the same as unset;
//!   anything else is an error naming the variable.
//! - Sizes: a byte count with an optional suffix, `K`/`M`/`G`/`T` or
//!   `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024) or `KB`/`MB`/`GB`/`TB`
//!   (powers of 1000), for example `512M`, `1G`, `1GiB`, `1048576`.
//! - Seconds: a whole number.

/// How a variable's value is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A boolean (see the module docs).
    Flag,
    /// A size in bytes, with an optional suffix.
    Bytes,
    /// Whole seconds.
    Seconds,
    /// A file or directory path.
    Path,
    /// Free text (a list, a command line, a platform name).
    Text,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Flag => "boolean",
            Kind::Bytes => "size",
            Kind::Seconds => "seconds",
            Kind::Path => "path",
            Kind::Text => "text",
        }
    }
}

/// One environment variable.
#[derive(Clone, Copy, Debug)]
pub struct Variable {
    /// The name, `XCALL_...`.
    pub name: &'static str,
    /// How its value is read.
    pub kind: Kind,
    /// What applies when it is unset.
    pub default: &'static str,
    /// Who reads it: the library, a command, the tests, a script.
    pub read_by: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

const fn var(
    name: &'static str,
    kind: Kind,
    default: &'static str,
    read_by: &'static str,
    meaning: &'static str,
) -> Variable {
    Variable {
        name,
        kind,
        default,
        read_by,
        meaning,
    }
}

/// Every variable xcall, its tests and its scripts read.
pub const VARIABLES: &[Variable] = &[
    var(
        "XCALL_DISABLE_CUDA",
        Kind::Flag,
        "off",
        "library",
        "Behave as on a machine without a GPU: CUDA is never loaded.",
    ),
    var(
        "XCALL_PERMUTE_AUTOTUNE",
        Kind::Flag,
        "on",
        "library",
        "Autotune the permutation kernels' launch configs on the first eager call per shape class.",
    ),
    var(
        "XCALL_PERMUTE_CHECK",
        Kind::Flag,
        "off",
        "library",
        "Checked mode for the permutation ops: every map is validated on the device before use.",
    ),
    var(
        "XCALL_SHMEM_HEAP_BYTES",
        Kind::Bytes,
        "1 GiB on CUDA, 64 MiB on Host",
        "library, `xcall moe`, `xcall bench`",
        "Symmetric heap per PE when the world's config names none. `xcall moe` and `xcall bench` size the heap themselves; they use this one instead when it is at least what the run needs, and refuse a smaller one.",
    ),
    var(
        "XCALL_SHMEM_TRANSPORT",
        Kind::Text,
        "auto",
        "library",
        "Which transport the pairs of a shmem world take when its config names none: `auto` (a PE of this process by address, of this host by shared memory or CUDA IPC, of another host through NCCL on CUDA and TCP connections on Host), `nccl` (NCCL for every pair, a PE with itself included, so one host or one GPU runs the path across hosts; CUDA only) or `tcp` (TCP connections for every pair but a PE with itself; Host only). Every PE of a world must use the same.",
    ),
    var(
        "XCALL_SHMEM_HOST",
        Kind::Text,
        "the hostname and boot id",
        "library",
        "Names this process's host in a shmem world (one line, 1 to 255 bytes). Processes of one machine given different names form a world of several hosts: their pairs take the transport across hosts (`auto`: NCCL on CUDA, TCP on Host) and each named host has its own state page, so one machine runs the path across hosts.",
    ),
    var(
        "XCALL_NCCL_LIB",
        Kind::Path,
        "searched",
        "library, `xcall doctor`",
        "The NCCL library (a file, or a folder holding `libnccl.so.2`) a CUDA world loads when a pair takes NCCL; nothing else is tried when it is set. Unset: the loader's path, then the NVIDIA Python wheels' `nvidia/nccl/lib` under the site-packages xcall finds. `xcall doctor` shows the one found.",
    ),
    var(
        "XCALL_LOG",
        Kind::Text,
        "off",
        "library, `xcall`",
        "Log lines on stderr, filtered in tracing's EnvFilter syntax: `info`, `debug`, `trace`, or per target such as `xcall_graph=debug,xcall_shmem=trace,warn`. Read on the first call into the library; `xcall_log_configure` replaces the filter and can send the lines to a callback instead. `debug` shows graph-cache decisions, each peer's transport, bootstrap steps, autotune choices and kernel compile times; `trace` adds every graph replay. A filter longer than 64 KiB is refused. An invalid filter: `xcall` exits with status 2, the library says so once on stderr and keeps logging off.",
    ),
    var(
        "XCALL_LIB",
        Kind::Path,
        "the package's own library",
        "Python (`xcall`)",
        "The `libxcall.so` the `xcall` package loads, in place of the one shipped inside it (a source checkout uses its `target/`).",
    ),
    var(
        "XCALL_TEST_INSTALLED",
        Kind::Flag,
        "off",
        "tests",
        "The JAX suite tests the installed `xcall` package and its shipped library instead of the source tree; it fails if `xcall` is imported from the checkout.",
    ),
    var(
        "XCALL_REQUIRE_CUDA",
        Kind::Flag,
        "off",
        "tests, device bundle",
        "A GPU test without a GPU fails instead of printing a SKIP line.",
    ),
    var(
        "XCALL_REQUIRE_GPUS",
        Kind::Text,
        "1 with `XCALL_REQUIRE_CUDA`, else 0",
        "device bundle",
        "A whole number: the device bundle's `run-all.sh` fails at once on a machine with fewer GPUs (the count `xcall doctor` reports). Under `XCALL_REQUIRE_CUDA=1` a test's skip for want of GPUs (\"needs N GPUs\" with N above the machine's count) counts as a skip, with its reason; set this to the machine's count where the multi-GPU tests must run.",
    ),
    var(
        "XCALL_REQUIRE_JAX",
        Kind::Flag,
        "off",
        "tests",
        "The JAX suite fails instead of skipping when JAX is missing.",
    ),
    var(
        "XCALL_REQUIRE_NCCL_ONE_SIDED",
        Kind::Flag,
        "off",
        "tests",
        "The one-sided NCCL tests (`cuda_nccl`) fail instead of skipping when the world's NCCL pairs fall back to two-sided NCCL (an NCCL older than 2.29, or one that runs no one-sided operations among the machine's GPUs). Unset, the device bundle's `run-all.sh` counts that skip as a skip even under `XCALL_REQUIRE_CUDA=1`.",
    ),
    var(
        "XCALL_REQUIRE_NVRTC",
        Kind::Flag,
        "off",
        "tests",
        "The compile-only kernel tests (every module compiled and assembled by NVRTC, no GPU) fail instead of skipping when NVRTC cannot be opened. CI sets it.",
    ),
    var(
        "XCALL_REQUIRE_PYTHON",
        Kind::Flag,
        "off",
        "tests",
        "The Python suites fail instead of skipping when no Python is found.",
    ),
    var(
        "XCALL_REQUIRE_SANITIZERS",
        Kind::Flag,
        "off",
        "tests",
        "The C tests fail instead of skipping when the compiler cannot build with sanitizers.",
    ),
    var(
        "XCALL_TEST_WATCHDOG_S",
        Kind::Seconds,
        "60",
        "tests",
        "How long a test waits for its threads or processes before failing.",
    ),
    var(
        "XCALL_PYTHON",
        Kind::Path,
        "`python3` on PATH",
        "tests, device bundle",
        "The Python interpreter the JAX suite runs with.",
    ),
    var(
        "XCALL_PYTEST_PYTHON",
        Kind::Path,
        "`python3` on PATH",
        "tests",
        "An interpreter with pytest for `scripts/bundle-run-all-test.sh`, which runs the device bundle's JAX passes through it over files that fail if collected. Without pytest that check is a skip, and a failure under `XCALL_REQUIRE_JAX=1`.",
    ),
    var(
        "XCALL_JAX_PLATFORMS",
        Kind::Text,
        "`cpu` under `cargo test`; every platform jaxlib sees under pytest",
        "tests",
        "The JAX platforms the JAX suite runs on, for example `cpu` or `cpu,gpu`.",
    ),
    var(
        "XCALL_JAX_REPORT",
        Kind::Path,
        "none",
        "tests",
        "A file the GPU JAX suite appends the graph-cache counters it observed to.",
    ),
    var(
        "XCALL_XLA_COMMAND_BUFFERS",
        Kind::Text,
        "unset (the checks that depend on it are skipped)",
        "tests",
        "`on` or `off`: whether the GPU JAX suite's `XLA_FLAGS` put the custom calls in XLA command buffers.",
    ),
    var(
        "XCALL_BIN",
        Kind::Path,
        "cargo's build of `xcall`",
        "tests",
        "The `xcall` binary the command tests run (set by the device bundle).",
    ),
    var(
        "XCALL_BLESS_HEADER",
        Kind::Flag,
        "off",
        "tests",
        "Rewrite `include/xcall.h` (and other generated files) instead of failing when they differ.",
    ),
    var(
        "XCALL_GRID_JSON",
        Kind::Path,
        "`permute-grid.json`",
        "`bench-cuda_permute_grid`",
        "Where the permute grid bench writes its JSON (the device bundle's `run-all.sh`: `permute-grid.json` among its logs).",
    ),
    var(
        "XCALL_GRID_QUICK",
        Kind::Flag,
        "off",
        "`bench-cuda_permute_grid`",
        "Run T = 4096 only (`run-all.sh --quick` sets it).",
    ),
    var(
        "XCALL_GRID_ONLY",
        Kind::Text,
        "every shape",
        "`bench-cuda_permute_grid`",
        "Run only the shapes matching `dtype:variant:T:E:H:topK`, each field a value or `*` (e.g. `f8e4m3:plain:16384:256:7168:8`), to profile one shape.",
    ),
    var(
        "XCALL_GRID_CONFIGS",
        Kind::Flag,
        "off",
        "`bench-cuda_permute_grid`",
        "Also replay permute, unpermute and the backward under every candidate launch config and print the tuned config's ratio beside the fastest's.",
    ),
    var(
        "XCALL_PERMUTE_CASES",
        Kind::Text,
        "the three upstream cases",
        "`bench-cuda_permute`",
        "The bf16 cases to run instead, `T,E,H,topK` separated by `;` (e.g. `4096,256,2048,8;16384,256,1024,8`).",
    ),
    var(
        "XCALL_EP_BENCH_GPUS",
        Kind::Text,
        "8",
        "`bench-cuda_ep`",
        "The most GPUs the expert-parallel bench runs on (it runs 1, 2, 4 and 8 up to it).",
    ),
    var(
        "XCALL_EP_BENCH_ONLY",
        Kind::Text,
        "none",
        "`bench-cuda_ep`",
        "Runs the expert-parallel bench on this many GPUs alone.",
    ),
    var(
        "XCALL_EP_BENCH_CASE",
        Kind::Text,
        "every case",
        "`bench-cuda_ep`",
        "Keeps the expert-parallel bench's cases whose name contains this text (e.g. `dsv3 bf16`).",
    ),
    var(
        "XCALL_BENCH_ARGS",
        Kind::Text,
        "none",
        "device bundle",
        "Arguments for the criterion benches `run-all.sh` runs (default: quick settings).",
    ),
    var(
        "XCALL_SOURCE_ROOT",
        Kind::Path,
        "the checkout the tests were built from",
        "tests",
        "The source tree whose files the tests compare against (docs, the report schema, the kept reports, the sources scanned for `XCALL_*` names). The device bundle's `run-all.sh` sets it to the copy it carries.",
    ),
    var(
        "XCALL_BUNDLE_LOGS",
        Kind::Path,
        "`logs/` in the bundle",
        "device bundle",
        "Where `run-all.sh` writes one log per program.",
    ),
    var(
        "XCALL_SANITIZERS",
        Kind::Text,
        "none",
        "device bundle",
        "compute-sanitizer tools `run-all.sh` also runs over the GPU tests, for example `memcheck racecheck synccheck`.",
    ),
    var(
        "XCALL_SHMEM_TEST_PE",
        Kind::Text,
        "unset",
        "tests (internal)",
        "Set by the multi-process shmem tests on the processes they start.",
    ),
    var(
        "XCALL_SHMEM_TEST_LAUNCH",
        Kind::Text,
        "unset",
        "tests (internal)",
        "Set by the launcher shmem test on the processes it starts (with a launcher's rank variables).",
    ),
    var(
        "XCALL_SHMEM_CUDA_TEST_PE",
        Kind::Text,
        "unset",
        "tests (internal)",
        "Set by the multi-process CUDA shmem tests on the processes they start.",
    ),
    var(
        "XCALL_SHMEM_FAILURE_PE",
        Kind::Text,
        "unset",
        "tests (internal)",
        "Set by the peer-failure shmem tests on the processes they start.",
    ),
    var(
        "XCALL_EP_TEST_PE",
        Kind::Text,
        "unset",
        "tests (internal)",
        "Set by the expert-parallel Host process tests on the PE processes they start.",
    ),
    var(
        "XCALL_VERIFY_RANDOM_CASES",
        Kind::Text,
        "600",
        "tests",
        "Random plans the model checker's reduction test compares with the full search (more for a longer check).",
    ),
];

/// A variable set to a value its kind does not accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not a {kind}: {expected}")]
pub struct EnvError {
    /// The variable.
    pub name: String,
    /// Its value.
    pub value: String,
    /// Its kind's name.
    pub kind: &'static str,
    /// The values accepted.
    pub expected: &'static str,
}

/// A boolean as the module docs spell it, or `None`.
pub fn parse_flag(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A size as the module docs spell it, or `None` (also when it does not
/// fit in 64 bits).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let unit: u64 = match suffix.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(unit)
}

/// Whole seconds, or `None`.
pub fn parse_seconds(s: &str) -> Option<u64> {
    s.trim().parse().ok()
}

/// The value of `name`, `None` when unset or empty (or not Unicode, which
/// no accepted value is: it is an error then).
fn raw(name: &str) -> Result<Option<String>, EnvError> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(EnvError {
            name: name.to_string(),
            value: v.to_string_lossy().into_owned(),
            kind: "text",
            expected: "valid UTF-8",
        }),
    }
}

fn read<T>(
    name: &str,
    kind: Kind,
    expected: &'static str,
    parse: fn(&str) -> Option<T>,
) -> Result<Option<T>, EnvError> {
    raw(name)?
        .map(|v| {
            parse(&v).ok_or_else(|| EnvError {
                name: name.to_string(),
                value: v,
                kind: kind.name(),
                expected,
            })
        })
        .transpose()
}

/// Text variable `name`: `None` when unset or empty (blank); an error when
/// it is not valid UTF-8.
pub fn text(name: &str) -> Result<Option<String>, EnvError> {
    raw(name)
}

/// Boolean variable `name`: `None` when unset or empty.
pub fn flag(name: &str) -> Result<Option<bool>, EnvError> {
    read(
        name,
        Kind::Flag,
        "1, 0, true, false, yes, no, on or off",
        parse_flag,
    )
}

/// Size variable `name` in bytes: `None` when unset or empty.
pub fn bytes(name: &str) -> Result<Option<u64>, EnvError> {
    read(
        name,
        Kind::Bytes,
        "a byte count with an optional suffix (512M, 1G, 1GiB, 1048576)",
        parse_bytes,
    )
}

/// Seconds variable `name`: `None` when unset or empty.
pub fn seconds(name: &str) -> Result<Option<u64>, EnvError> {
    read(name, Kind::Seconds, "whole seconds", parse_seconds)
}

/// The variable called `name`, if xcall knows it.
pub fn variable(name: &str) -> Option<&'static Variable> {
    VARIABLES.iter().find(|v| v.name == name)
}

/// `docs/ENVIRONMENT.md`: the spelling rules and one table row per
/// variable.
pub fn markdown_table() -> String {
    let mut s = String::from(
        "# Environment variables\n\n\
         Every `XCALL_*` variable that xcall, its tests and its scripts read.\n\
         This file is generated from `crates/xcall-core/src/env.rs` (a test\n\
         checks that it matches; `XCALL_BLESS_HEADER=1 cargo test -p\n\
         xcall-core --test environment` rewrites it).\n\n\
         - **boolean**: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`\n  \
         (any case); empty is the same as unset; any other value is an error\n  \
         that names the variable.\n\
         - **size**: a byte count with an optional suffix: `K`, `M`, `G`, `T`,\n  \
         `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024) or `KB`, `MB`, `GB`, `TB`\n  \
         (powers of 1000), for example `512M`, `1G`, `1GiB`, `1048576`.\n\
         - **seconds**: a whole number.\n\n\
         | variable | kind | default | read by | meaning |\n\
         |---|---|---|---|---|\n",
    );
    for v in VARIABLES {
        s += &format!(
            "| `{}` | {} | {} | {} | {} |\n",
            v.name,
            v.kind.name(),
            v.default,
            v.read_by,
            v.meaning
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_take_the_usual_spellings_and_nothing_else() {
        for t in ["1", "true", "TRUE", " yes ", "On"] {
            assert_eq!(parse_flag(t), Some(true), "{t}");
        }
        for f in ["0", "false", "No", "off", " OFF"] {
            assert_eq!(parse_flag(f), Some(false), "{f}");
        }
        for bad in ["", "2", "y", "enable", "truee", "-1"] {
            assert_eq!(parse_flag(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sizes_take_binary_and_decimal_suffixes_and_refuse_overflow() {
        let cases = [
            ("1048576", 1 << 20),
            ("0", 0),
            ("7B", 7),
            ("512K", 512 << 10),
            ("512M", 512 << 20),
            (" 1G ", 1 << 30),
            ("1GiB", 1 << 30),
            ("3MiB", 3 << 20),
            ("2T", 2 << 40),
            ("2TiB", 2 << 40),
            ("1KiB", 1024),
            ("1KB", 1000),
            ("5MB", 5_000_000),
            ("1GB", 1_000_000_000),
            ("1TB", 1_000_000_000_000),
            ("16 M", 16 << 20),
        ];
        for (s, want) in cases {
            assert_eq!(parse_bytes(s), Some(want), "{s}");
        }
        for bad in [
            "",
            "G",
            "1.5G",
            "-1",
            "1g",
            "1 GiBs",
            "12X",
            "18446744073709551616",
            "16777216T",
        ] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
        // The largest that fits, and one past it.
        assert_eq!(parse_bytes("16777215T"), Some(16777215u64 << 40));
        assert_eq!(parse_bytes("18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn seconds_are_whole_numbers() {
        assert_eq!(parse_seconds(" 90 "), Some(90));
        assert_eq!(parse_seconds("1.5"), None);
        assert_eq!(parse_seconds("-1"), None);
    }

    #[test]
    fn a_bad_value_names_the_variable_the_value_and_what_is_accepted() {
        // A name no one else reads, so the test owns it.
        let name = "XCALL_ENV_UNIT_TEST_FLAG";
        std::env::set_var(name, "maybe");
        let e = flag(name).unwrap_err();
        assert_eq!(
            e.to_string(),
            "XCALL_ENV_UNIT_TEST_FLAG=\"maybe\" is not a boolean: 1, 0, true, false, yes, no, on or off"
        );
        std::env::set_var(name, "  ");
        assert_eq!(flag(name), Ok(None));
        std::env::set_var(name, "Yes");
        assert_eq!(flag(name), Ok(Some(true)));
        std::env::set_var(name, "2G");
        assert_eq!(bytes(name), Ok(Some(2 << 30)));
        assert!(seconds(name)
            .unwrap_err()
            .to_string()
            .contains("whole seconds"));
        std::env::remove_var(name);
        assert_eq!(bytes(name), Ok(None));
    }

    #[test]
    fn every_variable_is_listed_once_with_its_prefix() {
        let mut names: Vec<&str> = VARIABLES.iter().map(|v| v.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a variable is listed twice");
        for v in VARIABLES {
            assert!(v.name.starts_with("XCALL_"), "{}", v.name);
            assert!(!v.meaning.is_empty() && !v.read_by.is_empty(), "{}", v.name);
        }
        assert_eq!(variable("XCALL_DISABLE_CUDA").unwrap().kind, Kind::Flag);
        assert!(variable("XCALL_NOT_A_VARIABLE").is_none());
    }
}
