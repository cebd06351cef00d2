//! The `xcall` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod alloc;
mod bench;
mod doctor;
mod layer;
mod moe;
mod plot;
mod report;

use report::Failure;

/// The exit statuses, in every command's --help.
const EXIT_STATUSES: &str = "Exit status: 0 success; 1 a runtime error or a result that did not \
verify; 2 a usage error (a flag clap refuses, a value out of range, an output path that cannot \
be written, a malformed XCALL_* variable). Errors are one line on stderr, \"xcall: <what>\".";

#[derive(Parser)]
#[command(
    name = "xcall",
    version,
    about = "xcall: custom-call runtime pieces for many GPUs",
    after_help = EXIT_STATUSES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report the platforms and devices xcall can use (exit 0 without a GPU).
    #[command(after_help = EXIT_STATUSES)]
    Doctor(doctor::DoctorArgs),
    /// Run an expert-parallel MoE layer (permute, shmem dispatch and
    /// combine, warp-specialized experts, graph cache) and check it.
    #[command(after_help = EXIT_STATUSES)]
    Moe(moe::MoeArgs),
    /// Run the benchmark set of every crate in one process; every figure
    /// next to a reference measured in the same run.
    #[command(after_help = EXIT_STATUSES)]
    Bench(bench::BenchArgs),
    /// Draw SVG charts from the JSON reports of `bench` and `moe`.
    #[command(after_help = EXIT_STATUSES)]
    Plot(plot::PlotArgs),
}

fn main() -> ExitCode {
    // A closed stdout (`xcall moe | head`) ends the process quietly, as
    // for any Unix tool, instead of panicking in println!.
    // SAFETY: sets the default disposition of one signal before any other
    // thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    // XCALL_LOG turns logging on (stderr); a filter that does not parse is
    // a usage error like a bad flag.
    if let Err(xcall_core::Error::InvalidArgument(e)) = xcall_core::log::init_from_env() {
        eprintln!("xcall: {e}");
        return ExitCode::from(2);
    }
    let result: Result<bool, Failure> = match cli.command {
        Command::Doctor(args) => doctor::run(&args),
        Command::Moe(args) => moe::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Plot(args) => plot::run(&args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("xcall: {}", e.message());
            ExitCode::from(e.exit_code())
        }
    }
}

/// Help and version as clap prints them; a usage error as one line
/// (`xcall: <what>; <hints>`) and exit code 2.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let text = e.render().to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .map(|l| l.trim_start_matches("error: "))
        .collect();
    eprintln!("xcall: {}", parts.join("; "));
    ExitCode::from(2)
}
