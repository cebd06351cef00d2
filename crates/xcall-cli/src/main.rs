//! The `xcall` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod doctor;
mod moe;

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
    /// Run an expert-parallel MoE layer (permute, shmem dispatch and
    /// combine, warp-specialized experts, graph cache) and check it.
    Moe(moe::MoeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor::run(&mut std::io::stdout().lock())
            .map(|()| true)
            .map_err(|e| e.to_string()),
        Command::Moe(args) => moe::run(&args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("xcall: {e}");
            ExitCode::FAILURE
        }
    }
}
