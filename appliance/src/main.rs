//! `siteboot`: a per-site network-boot appliance. See `siteboot --help`.

mod config;
mod serve;
mod standalone;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::Config;

/// A per-site network-boot appliance: DHCP, TFTP, iPXE scripts and HTTP from one binary.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve DHCP, TFTP and HTTP as configured in FILE (standalone mode, no Kubernetes).
    ///
    /// Logs go to stderr; set SITEBOOT_LOG (e.g. `debug`, `siteboot_boot=debug`) to change the
    /// level. Needs root (or CAP_NET_BIND_SERVICE + CAP_NET_RAW) for ports 67, 69 and 4011.
    Serve {
        /// The configuration file (see examples/standalone.yaml).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Check a configuration file and exit: 0 if it is valid, 1 with the field and the problem
    /// if not.
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::CheckConfig { file } => match Config::load(&file) {
            Ok(config) => {
                println!(
                    "{}: ok ({} DHCP, {} known hosts, iPXE binaries for {})",
                    file.display(),
                    format!("{:?}", config.dhcp.mode).to_lowercase(),
                    config.inventory.known_hosts(),
                    config
                        .binaries
                        .platforms()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Serve { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(serve::serve(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SITEBOOT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
