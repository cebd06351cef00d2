//! The `xcall` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod doctor;

#[derive(Parser)]
#[command(
    name = "xcall",
    version,
    about = "xcall: custom-call runtime pieces for many GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report the platforms and devices xcall can use (exit 0 without a GPU).
    Doctor,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(&mut std::io::stdout().lock()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xcall: {e}");
            ExitCode::FAILURE
        }
    }
}
