//! The control socket of a standalone appliance: `siteboot host ...` asks the running
//! `siteboot serve` to start or cancel an operation and follows it here.
//!
//! A Unix socket, `<state_dir>/control/siteboot.sock`, in a directory only root may enter and
//! itself mode 0600: who may use it is who may read the state directory, with no password or
//! port to guard, and it answers at once (an unknown host, a busy one, no image) instead of
//! leaving a request file nobody may ever pick up. One JSON request per connection, one JSON
//! answer.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use siteboot_agent_server::OperationKind;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use crate::standalone::{HostView, StaticInventory};

/// The longest request read (a host name and a verb).
const MAX_REQUEST: u64 = 4096;
/// How long a client has to send its request, and the CLI to get most answers.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Start an operation on a host (or follow the one of that kind under way).
    Start {
        host: String,
        kind: OperationKind,
    },
    /// End the operation under way on a host.
    Cancel {
        host: String,
    },
    Show {
        host: String,
    },
    List,
}

impl Request {
    /// How long the CLI waits for the answer: starting an operation may wait for the host's
    /// BMC.
    fn answer_within(&self) -> Duration {
        match self {
            Request::Start { .. } => crate::bmc::BMC_TIMEOUT + IO_TIMEOUT,
            Request::Cancel { .. } | Request::Show { .. } | Request::List => IO_TIMEOUT,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    Host(Box<HostView>),
    Hosts(Vec<HostView>),
    Error(String),
}

pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("control").join("siteboot.sock")
}

/// Binds the socket (replacing one a killed appliance left).
pub fn bind(state_dir: &Path) -> Result<UnixListener> {
    let path = socket_path(state_dir);
    let dir = path.parent().expect("the socket is in a directory");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing the old {}", path.display()));
        }
        _ => {}
    }
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Answers requests until `stop`.
pub async fn serve(
    listener: UnixListener,
    inventory: Arc<StaticInventory>,
    stop: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "control socket accept failed");
                    continue;
                }
            },
        };
        let inventory = inventory.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            let mut reader = tokio::io::BufReader::new(read.take(MAX_REQUEST));
            let read = tokio::time::timeout(IO_TIMEOUT, reader.read_line(&mut line)).await;
            let answer = match read {
                Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
                    Ok(request) => answer(&inventory, request).await,
                    Err(e) => Answer::Error(format!("bad request: {e}")),
                },
                _ => return,
            };
            let mut text = serde_json::to_vec(&answer).expect("an answer serializes");
            text.push(b'\n');
            let _ = tokio::time::timeout(IO_TIMEOUT, write.write_all(&text)).await;
        });
    }
}

async fn answer(inventory: &StaticInventory, request: Request) -> Answer {
    let result = match request {
        Request::Start { host, kind } => {
            inventory.start(&host, kind).await.map(|h| Answer::Host(Box::new(h)))
        }
        Request::Cancel { host } => inventory.cancel(&host).map(|h| Answer::Host(Box::new(h))),
        Request::Show { host } => inventory.show(&host).map(|h| Answer::Host(Box::new(h))),
        Request::List => Ok(Answer::Hosts(inventory.list())),
    };
    result.unwrap_or_else(|e| Answer::Error(e.to_string()))
}

/// Sends `request` to the appliance whose state is in `state_dir`.
pub fn call(state_dir: &Path, request: &Request) -> Result<Answer> {
    let path = socket_path(state_dir);
    let mut stream = std::os::unix::net::UnixStream::connect(&path).with_context(|| {
        format!("connecting to {} (is `siteboot serve` running with this config?)", path.display())
    })?;
    stream.set_read_timeout(Some(request.answer_within()))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut text = serde_json::to_vec(request)?;
    text.push(b'\n');
    stream.write_all(&text)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.is_empty() {
        bail!("the appliance closed the control socket without an answer");
    }
    Ok(serde_json::from_str(&line)?)
}
