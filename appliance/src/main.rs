//! `siteboot`: a per-site network-boot appliance. See `siteboot --help`.

mod bmc;
mod config;
mod control;
mod fd_limit;
mod host;
mod image;
mod interface;
#[cfg_attr(not(feature = "kubernetes"), path = "no_kubernetes.rs")]
mod kubernetes;
mod operations;
mod owner_only;
// Checks the examples show every field; kubernetes.yaml's need Kubernetes mode.
#[cfg(all(test, feature = "kubernetes"))]
mod serde_keys;
mod serve;
mod ssh;
mod standalone;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{Config, ConfigError, MissingDir};

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
    /// level. Needs root or CAP_NET_BIND_SERVICE for ports 67, 69 and 4011, and CAP_NET_RAW for
    /// the ARP probe that confirms an on-link host before its ramdisk token and bootstrap data
    /// (without it, no on-link host gets a token).
    ///
    /// With --kubeconfig or --site (or a `kubernetes:` config section), it also runs the Cluster
    /// API provider for that site: Hosts come from the management cluster and their state
    /// decides what each boots.
    Serve {
        /// The configuration file (see examples/standalone.yaml, examples/kubernetes.yaml).
        #[arg(long, short)]
        config: PathBuf,
        #[command(flatten)]
        kubernetes: kubernetes::ServeArgs,
    },
    /// Print the CRDs (with the admission policy that keeps templates immutable) and RBAC as
    /// YAML, or write everything under deploy/ into a directory.
    ///
    /// --output-dir writes crds.yaml, rbac.yaml, kubernetes/appliance.yaml (an example site's
    /// appliance) and the clusterctl release, a local provider repository:
    /// clusterctl/infrastructure-siteboot/v<version>/{metadata.yaml,
    /// infrastructure-components.yaml, cluster-template.yaml}.
    #[cfg(feature = "kubernetes")]
    Manifests(kubernetes::ManifestsArgs),
    /// Check a configuration file and exit: 0 if it is valid, 1 with the field and the problem
    /// if not.
    ///
    /// A served content directory (http.root, tftp.root) this machine does not have yet is a
    /// warning, not an error: the file is valid, but `serve` refuses to start until it exists.
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
    },
    /// Ask the appliance running with this configuration for `healthz` (it answers) or
    /// `readyz` (its inventory can answer) on its plain HTTP port: exit 0 on 200, 1 otherwise.
    /// A container's exec probe, for replicas whose address is their own node's (an unset
    /// `address`), which a probe's fixed `host` cannot name.
    Probe {
        /// The configuration file the appliance runs with (for address and http.port).
        #[arg(long, short, default_value = "/etc/siteboot/siteboot.yaml")]
        config: PathBuf,
        #[arg(value_parser = ["healthz", "readyz"])]
        check: String,
    },
    /// The image cache in <state_dir>/images: images fetched once, verified by sha256, kept by
    /// digest, the least recently used evicted beyond images.max_bytes.
    Image {
        /// The configuration file (for state_dir and images.max_bytes).
        #[arg(long, short, global = true, default_value = "/etc/siteboot/siteboot.yaml")]
        config: PathBuf,
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// Standalone host operations: ask the running `siteboot serve` (through the control
    /// socket in <state_dir>/control, root only) to inspect, provision or wipe a host listed
    /// under `hosts` (by name or MAC), and follow it until it ends; or cancel it. The host
    /// boots the ramdisk (`ramdisk_profile`) at its next network boot: siteboot boots it
    /// through its `bmc` if it has one, else power-cycle it. A host with `ssh` boots nothing:
    /// its operations run over SSH on the OS it runs.
    Host {
        /// The configuration file the appliance runs with (for state_dir).
        #[arg(long, short, global = true, default_value = "/etc/siteboot/siteboot.yaml")]
        config: PathBuf,
        /// How long to follow an operation before giving up (it keeps running).
        #[arg(long, global = true, default_value = "2h", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        #[command(subcommand)]
        command: HostCommand,
    },
}

#[derive(Subcommand)]
enum HostCommand {
    /// Each host's state, profile and last operation.
    List,
    /// Boot the ramdisk (or, with `ssh`, log in) and record the host's hardware.
    Inspect { name: String },
    /// Write the host's image and user-data (its `image`, `user_data`, `root_device_hints`);
    /// with `ssh`, adopt it as it runs: its `user_data` run once by its own cloud-init (or as
    /// a script, if it starts with `#!`).
    Provision { name: String },
    /// Wipe the host's disks (its `wipe` policy); with `ssh`, reset it: its Kubernetes state
    /// (kubelet, containerd's, CNI, certificates) removed and checked gone, its OS and data kept.
    Deprovision { name: String },
    /// End the host's operation now: its ramdisk's token stops working. A cancelled
    /// provisioning leaves the host wipe-required if its ramdisk had booted.
    Cancel { name: String },
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Fetch an image into the cache (unless it is there) and verify it; progress on stderr.
    Pull {
        /// http://, https:// or file:///path.
        url: String,
        /// The digest the image must have: 64 hex digits, with or without `sha256:`.
        #[arg(long)]
        sha256: String,
    },
    /// List the cached images: digest, size, last use and source URL.
    List,
    /// Remove a cached image (refused while this process is downloading or serving it).
    Rm {
        /// `sha256:<hex>` or the bare hex.
        digest: String,
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
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one command; its error is what `main` prints before exiting with failure.
fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::CheckConfig { file } => {
            let CheckedConfig { config, media, missing_dirs } = check_config(&file)?;
            let media = match media {
                Some(media) => format!(", boot media of {} bytes", media.file_len()),
                None => String::new(),
            };
            println!(
                "{}: ok ({} DHCP, {} known hosts, iPXE binaries for {}{media})",
                file.display(),
                format!("{:?}", config.dhcp.mode).to_lowercase(),
                config.inventory.known_hosts(),
                config.binaries.platforms().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
            );
            // A fresh machine has none of the site's own directories yet: the file is valid, so
            // this passes, and the operator learns what `serve` refuses to start without.
            for missing in missing_dirs {
                let missing = ConfigError::in_file(&file, missing.into());
                eprintln!(
                    "warning: {missing}; the configuration is valid, but `siteboot serve` needs it"
                );
            }
            Ok(())
        }
        Command::Probe { config, check } => {
            let config = Config::load(&config)?;
            probe((config.address, config.http.port).into(), &check)
        }
        Command::Image { config, command } => {
            let config = Config::load(&config)?;
            match command {
                ImageCommand::Pull { url, sha256 } => image::pull(&config, &url, &sha256),
                ImageCommand::List => image::list(&config),
                ImageCommand::Rm { digest } => image::rm(&config, &digest),
            }
        }
        Command::Host { config, timeout, command } => {
            use siteboot_agent_server::OperationKind;
            let config = Config::load(&config)?;
            let dir = &config.state_dir;
            match command {
                HostCommand::List => host::list(dir),
                HostCommand::Inspect { name } => {
                    host::run(dir, &name, OperationKind::Inspect, timeout)
                }
                HostCommand::Provision { name } => {
                    host::run(dir, &name, OperationKind::Provision, timeout)
                }
                HostCommand::Deprovision { name } => {
                    host::run(dir, &name, OperationKind::Deprovision, timeout)
                }
                HostCommand::Cancel { name } => host::cancel(dir, &name),
            }
        }
        #[cfg(feature = "kubernetes")]
        Command::Manifests(args) => kubernetes::manifests(args),
        Command::Serve { config: file, kubernetes } => {
            let config = Config::load(&file)?;
            // Strict where check-config only warns: there is nothing to serve from them.
            config.require_content_dirs().map_err(|e| ConfigError::in_file(&file, e))?;
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            let served = runtime.block_on(kubernetes.serve(config));
            // In the log too: an appliance's stderr is often only its log.
            served.inspect_err(|e| tracing::error!("{e:#}"))
        }
    }
}

/// What `siteboot check-config` found in a valid file.
struct CheckedConfig {
    config: Config,
    /// The boot media it names, read as `serve` reads it.
    media: Option<siteboot_boot::media::BootMedia>,
    /// The served content directories `serve` needs that this machine does not have.
    missing_dirs: Vec<MissingDir>,
}

/// `siteboot check-config`: the file, the boot media it names and its content directories.
fn check_config(file: &std::path::Path) -> Result<CheckedConfig, ConfigError> {
    let config = Config::load(file)?;
    let media = config.open_ramdisk_media().map_err(|e| ConfigError::in_file(file, e))?;
    let missing_dirs = config.missing_content_dirs().map_err(|e| ConfigError::in_file(file, e))?;
    Ok(CheckedConfig { config, media, missing_dirs })
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

/// `siteboot probe`: `GET /<check>` at `at` (the appliance's plain HTTP port), answered 200
/// within 5 s.
fn probe(at: std::net::SocketAddr, check: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let deadline = std::time::Duration::from_secs(5);
    let mut stream = std::net::TcpStream::connect_timeout(&at, deadline)
        .with_context(|| format!("connecting to {at}"))?;
    stream.set_read_timeout(Some(deadline))?;
    stream.set_write_timeout(Some(deadline))?;
    stream.write_all(format!("GET /{check} HTTP/1.0\r\nHost: {at}\r\n\r\n").as_bytes())?;
    let mut answer = String::new();
    stream.take(4096).read_to_string(&mut answer).with_context(|| format!("reading from {at}"))?;
    let status_line = answer.lines().next().unwrap_or_default();
    match status_line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        _ => anyhow::bail!("{at}/{check}: {status_line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::thread::JoinHandle;

    use super::probe;

    /// A server that answers one request with `status_line`, and returns the request it read.
    fn answering_once(status_line: &'static str) -> (SocketAddr, JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut connection, _) = listener.accept().unwrap();
            let mut request = [0; 1024];
            let n = connection.read(&mut request).unwrap();
            let answer = format!("{status_line}\r\nContent-Length: 0\r\n\r\n");
            connection.write_all(answer.as_bytes()).unwrap();
            String::from_utf8_lossy(&request[..n]).into_owned()
        });
        (at, server)
    }

    #[test]
    fn a_probe_passes_on_200_only() {
        let (at, server) = answering_once("HTTP/1.1 200 OK");
        probe(at, "readyz").unwrap();
        assert!(server.join().unwrap().starts_with("GET /readyz HTTP/1.0\r\n"));
        let (at, server) = answering_once("HTTP/1.1 503 Service Unavailable");
        let refused = probe(at, "readyz").unwrap_err();
        server.join().unwrap();
        assert!(refused.to_string().contains("503"), "{refused}");
    }
}
