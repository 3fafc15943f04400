//! HTTP: one file to N concurrent curl clients at once, siteboot against nginx with sendfile.
//! Throughput is the bytes of all clients over the time from the first start to the last finish.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Lab, SERVER_ADDRESS, Settings};
use crate::appliance::{Appliance, BRIDGE};
use crate::process::Supervised;

/// The HTTP port of both servers (also the requests benchmark's).
pub(super) const PORT: u16 = 8080;
const FILE: &str = "image.bin";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub server: String,
    pub clients: usize,
    pub run: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub server_cpu_seconds: f64,
    /// Peak RSS of the server process during the sample (siteboot only; nginx's workers are
    /// separate processes).
    pub peak_rss_kib: Option<u64>,
}

/// Every run of every concurrency, for siteboot and nginx.
pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let file_dir = dir.join("http-root");
    std::fs::create_dir_all(&file_dir)?;
    super::write_file(&file_dir.join(FILE), settings.http_bytes)?;
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        for server in ["siteboot", "nginx"] {
            let lab = Lab::new("bh")?;
            lab.address_client()?;
            let running = match server {
                "siteboot" => Server::Siteboot(start_siteboot(&lab, &file_dir)?),
                _ => Server::Nginx(start_nginx(&lab, &file_dir, dir)?),
            };
            wait_ready(&lab)?;
            for &clients in &settings.http_clients {
                let pid = running.pid();
                if matches!(running, Server::Siteboot(_)) {
                    super::reset_peak_rss(pid)?;
                }
                let cpu = super::cpu_seconds(pid);
                let (bytes, seconds) = download(&lab, clients, settings.http_bytes)?;
                let sample = Sample {
                    server: server.to_owned(),
                    clients,
                    run,
                    bytes,
                    seconds,
                    server_cpu_seconds: super::cpu_seconds(pid) - cpu,
                    peak_rss_kib: match running {
                        Server::Siteboot(_) => Some(super::peak_rss_kib(pid)?),
                        Server::Nginx(_) => None,
                    },
                };
                eprintln!(
                    "http {server} clients={clients} run={run}: {:.0} MiB/s",
                    bytes as f64 / seconds / f64::from(1 << 20)
                );
                samples.push(sample);
            }
        }
    }
    Ok(samples)
}

enum Server {
    Siteboot(Appliance),
    Nginx(Supervised),
}

impl Server {
    fn pid(&self) -> u32 {
        match self {
            Server::Siteboot(a) => a.pid().expect("siteboot runs"),
            Server::Nginx(p) => p.pid(),
        }
    }
}

/// siteboot as installed, DHCP off, with the HTTP root holding the file. The per-address cap
/// is raised to 64: every bench client comes from one address, and nginx has no such cap.
fn start_siteboot(lab: &Lab, root: &Path) -> Result<Appliance> {
    let config = json!({
        "interface": BRIDGE,
        "address": SERVER_ADDRESS,
        "dhcp": { "mode": "off" },
        "http": { "port": PORT, "root": root, "max_connections_per_address": 64 },
        "profiles": { "none": { "script": "#!ipxe\nexit\n" } },
    });
    Appliance::start(&lab.server, config)
}

/// nginx as its package would serve static files, with sendfile (and tcp_nopush), one worker
/// per CPU, no access log: `root` at `/files/`, and its `boot/` at `/boot/` (the requests
/// benchmark's scripts).
pub(super) fn start_nginx(lab: &Lab, root: &Path, dir: &Path) -> Result<Supervised> {
    let prefix = dir.join("nginx");
    std::fs::create_dir_all(prefix.join("tmp"))?;
    let conf = prefix.join("nginx.conf");
    let p = prefix.display();
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nmaster_process on;\nuser root;\nworker_processes auto;\n\
             pid {p}/nginx.pid;\nerror_log stderr warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  sendfile on;\n  tcp_nopush on;\n  tcp_nodelay on;\n\
             \x20 keepalive_timeout 30s;\n  client_body_temp_path {p}/tmp/body;\n\
             \x20 proxy_temp_path {p}/tmp/proxy;\n  fastcgi_temp_path {p}/tmp/fastcgi;\n\
             \x20 uwsgi_temp_path {p}/tmp/uwsgi;\n  scgi_temp_path {p}/tmp/scgi;\n\
             \x20 server {{\n    listen {SERVER_ADDRESS}:{PORT};\n\
             \x20   location /files/ {{ alias {root}/; }}\n\
             \x20   location /boot/ {{ alias {root}/boot/; }}\n  }}\n}}\n",
            root = root.display()
        ),
    )?;
    let mut command = lab.server.command("nginx");
    command.arg("-e").arg("stderr").arg("-p").arg(&prefix).arg("-c").arg(&conf);
    Supervised::spawn("nginx", &mut command, &prefix)
}

fn url() -> String {
    format!("http://{SERVER_ADDRESS}:{PORT}/files/{FILE}")
}

fn wait_ready(lab: &Lab) -> Result<()> {
    super::wait_for("the HTTP server to answer HEAD", Duration::from_secs(20), || {
        lab.client
            .command("curl")
            .args(["-sfI", "--max-time", "2", &url()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// `clients` curls at once, each fetching the whole file to /dev/null. Returns (bytes, seconds).
fn download(lab: &Lab, clients: usize, size: u64) -> Result<(u64, f64)> {
    // Generous: 10 MiB/s per client at the least.
    let limit = 60 + size * clients as u64 / (10 << 20);
    let started = Instant::now();
    let children: Vec<Child> = (0..clients)
        .map(|_| {
            lab.client
                .command("curl")
                .args(["-sS", "-o", "/dev/null", "-w", "%{size_download}"])
                .args(["--max-time", &limit.to_string(), &url()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting curl")
        })
        .collect::<Result<_>>()?;
    let mut bytes = 0;
    for child in children {
        // curl's --max-time bounds each wait.
        let out = child.wait_with_output()?;
        let got: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
        if !out.status.success() || got != size {
            bail!(
                "curl got {got} of {size} bytes ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        bytes += got;
    }
    Ok((bytes, started.elapsed().as_secs_f64()))
}
