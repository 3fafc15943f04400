//! The handlers: what each route answers, and what it records (metrics, the timeline, logs).

use super::*;

/// What the file routes (`/files/`, `/images/`, `/ipxe/`) take from their request besides the
/// path, passed whole down to [`HttpServer::serve`].
pub(super) struct FileRequest<'a> {
    pub req: &'a Request<Incoming>,
    /// A HEAD: headers only, and no timeline entry.
    pub head: bool,
    pub remote: SocketAddr,
    /// The connection's sendfile queue; only plain HTTP connections have one.
    pub chunks: Option<Arc<FileChunks>>,
}

impl HttpServer {
    /// 200 once the inventory can answer (in Kubernetes mode: the Host cache has synced),
    /// else 503 with why. Liveness is `/healthz`.
    pub(super) fn readiness(&self) -> Response<Body> {
        match self.plane.inventory.ready() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("not ready: {why}\n")),
        }
    }

    pub(super) fn metrics_page(&self) -> Response<Body> {
        Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
            .body(full(self.plane.metrics.render(&self.plane.timeline)))
            .expect("valid response")
    }

    pub(super) async fn script(&self, file: &str, remote: SocketAddr) -> Response<Body> {
        let Some(mac) = file.strip_suffix(".ipxe").and_then(|m| m.parse::<MacAddr>().ok()) else {
            return text(StatusCode::NOT_FOUND, "expected /boot/<mac>.ipxe\n");
        };
        let Some(remote_ip) = ipv4(remote) else {
            return text(StatusCode::NOT_FOUND, "boot scripts are served over IPv4\n");
        };
        let request = BootRequest {
            mac,
            remote: remote_ip,
            remote_holds_mac: self.plane.neighbors.mac_of(remote_ip) == Some(mac),
            segment: Segment(self.plane.neighbors.clone()),
        };
        match self.plane.inventory.boot_action(request).await {
            Some(action) => {
                let script = ipxe_script(&action, mac, &self.plane.endpoints, &self.agent);
                self.plane.timeline.record(mac, Stage::IpxeScript, describe_script(&script));
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/plain")
                    .header(header::CACHE_CONTROL, "no-store")
                    .body(full(script))
                    .expect("valid response")
            }
            None => {
                tracing::info!(%mac, "no boot action for this host; answering 404");
                text(StatusCode::NOT_FOUND, "no boot action for this host\n")
            }
        }
    }

    pub(super) async fn file(&self, path: &str, request: FileRequest<'_>) -> Response<Body> {
        let Some(root) = &self.files else {
            return text(StatusCode::NOT_FOUND, "no http.root configured\n");
        };
        let decoded = percent_decode(path);
        let Some(decoded) = decoded else {
            return text(StatusCode::BAD_REQUEST, "bad percent-encoding\n");
        };
        self.serve(root.open_file(&decoded), &decoded, request).await
    }

    pub(super) async fn image(&self, path: &str, request: FileRequest<'_>) -> Response<Body> {
        let Some(images) = &self.images else {
            return text(StatusCode::NOT_FOUND, "this appliance serves no images\n");
        };
        // Only names the cache gives its files: nothing else in its directory is served.
        let digest = path.strip_prefix("sha256/").and_then(|hex| Digest::from_hex(hex).ok());
        let Some(digest) = digest else {
            return text(StatusCode::NOT_FOUND, "expected /images/sha256/<64 lower-case hex>\n");
        };
        // The digest is the only key to a tenant's image: timelines and logs name the route only.
        self.serve(images.open_file(&digest.hex()), IMAGE_STEP, request).await
    }

    pub(super) async fn ipxe_binary(&self, name: &str, request: FileRequest<'_>) -> Response<Body> {
        if !self.plane.binaries.is_binary(name) {
            return text(StatusCode::NOT_FOUND, "not an iPXE binary served here\n");
        }
        self.serve(self.ipxe_root.open_file(name), name, request).await
    }

    pub(super) async fn serve(
        &self,
        opened: Result<(std::fs::File, u64), FileError>,
        name: &str,
        request: FileRequest<'_>,
    ) -> Response<Body> {
        let FileRequest { req, head, remote, chunks } = request;
        // Files are routes of the plain HTTP port, whose connections all have a chunk queue.
        let Some(chunks) = chunks else {
            return text(StatusCode::NOT_FOUND, "files are served over plain HTTP only\n");
        };
        let (file, len) = match opened {
            Ok(found) => found,
            Err(e @ (FileError::NotFound | FileError::NotAFile)) => {
                // In the host's timeline: the boot script asked for it, and its retries will.
                if let (false, Some(mac)) = (head, self.mac_of(remote)) {
                    let detail = format!("{name} 404 ({e})");
                    self.plane.timeline.record(mac, Stage::HttpFile, detail);
                }
                return text(StatusCode::NOT_FOUND, &format!("{e}\n"));
            }
            Err(e @ (FileError::OutsideRoot | FileError::InvalidPath(_))) => {
                tracing::warn!(%remote, path = name, error = %e, "refused an HTTP path");
                return text(StatusCode::FORBIDDEN, &format!("{e}\n"));
            }
            Err(FileError::Io(e)) => {
                tracing::error!(%remote, path = name, error = %e, "cannot open file");
                return text(StatusCode::INTERNAL_SERVER_ERROR, "cannot open file\n");
            }
        };
        match static_files::respond(
            file,
            len,
            req.headers(),
            head,
            chunks,
            self.plane.metrics.clone(),
        ) {
            Ok(response) => {
                if let (false, Some(mac)) = (head, self.mac_of(remote)) {
                    self.plane.timeline.record(
                        mac,
                        Stage::HttpFile,
                        format!("{name} {} ({len} bytes)", response.status().as_u16()),
                    );
                }
                response
            }
            Err(e) => {
                tracing::error!(%remote, path = name, error = %e, "cannot read file");
                text(StatusCode::INTERNAL_SERVER_ERROR, "cannot read file\n")
            }
        }
    }

    /// `GET|HEAD /media/<file>` (HTTPS): the boot media for the key in `file`.
    pub(super) async fn media(
        &self,
        file: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
    ) -> Response<Body> {
        let method = if head { "HEAD" } else { "GET" };
        let log = |status: StatusCode, outcome: &dyn std::fmt::Display| {
            tracing::info!(%remote, method, status = status.as_u16(), %outcome, "boot media request");
        };
        let Some(media) = &self.media else {
            log(StatusCode::NOT_FOUND, &"no boot media configured");
            return text(StatusCode::NOT_FOUND, "no boot media here\n");
        };
        let Some(key) = file.strip_suffix(".iso").filter(|key| is_media_key(key)) else {
            log(StatusCode::NOT_FOUND, &"not a media key");
            return text(StatusCode::NOT_FOUND, "expected /media/<64 lower-case hex>.iso\n");
        };
        let Some(remote_ip) = ipv4(remote) else {
            log(StatusCode::NOT_FOUND, &"not IPv4");
            return text(StatusCode::NOT_FOUND, "boot media is served over IPv4\n");
        };
        let request = MediaRequest { key: key.to_owned(), remote: remote_ip };
        let Some(cmdline) = self.plane.inventory.media(request).await else {
            log(StatusCode::NOT_FOUND, &"no such media");
            return text(StatusCode::NOT_FOUND, "no such media\n");
        };
        let cmdline = media_cmdline(&cmdline, &self.plane.endpoints, &self.agent);
        let params = match MediaParams::new(&cmdline) {
            Ok(params) => params,
            Err(e) => {
                // The error names a word by its place and the character only, never a word.
                tracing::error!(%remote, error = %e, "cannot write a kernel command line into the boot media");
                log(StatusCode::INTERNAL_SERVER_ERROR, &"command line does not fit the media");
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot write this media's kernel command line\n",
                );
            }
        };
        if let Err(e) = media.check_unchanged() {
            tracing::error!(%remote, error = %e, "cannot serve the boot media");
            log(StatusCode::INTERNAL_SERVER_ERROR, &"the media file changed");
            return text(StatusCode::INTERNAL_SERVER_ERROR, "cannot read the boot media\n");
        }
        let (response, range) = boot_media::respond(
            media.clone(),
            params,
            req.headers(),
            head,
            self.plane.metrics.clone(),
        );
        let status = response.status();
        match range {
            RangeRequest::Full => log(status, &format_args!("whole ({} bytes)", media.file_len())),
            RangeRequest::Partial { start, end } => {
                log(status, &format_args!("bytes {start}-{end}"))
            }
            RangeRequest::Unsatisfiable => log(status, &"range not satisfiable"),
        }
        response
    }

    pub(super) async fn agent(
        &self,
        req: Request<Incoming>,
        path: String,
        remote: SocketAddr,
    ) -> Response<Body> {
        let Some(remote_ip) = ipv4(remote) else {
            return text(StatusCode::FORBIDDEN, "the agent API is served over IPv4\n");
        };
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_owned());
        let method = req.method().clone();
        let collect = Limited::new(req.into_body(), MAX_AGENT_BODY).collect();
        let body = match tokio::time::timeout(self.body_timeout, collect).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(_)) => return text(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n"),
            Err(_elapsed) => {
                Metrics::add(&self.plane.metrics.http_timeouts, 1);
                tracing::info!(%remote, "agent request body not received in time");
                return closing(text(StatusCode::REQUEST_TIMEOUT, "request body too slow\n"));
            }
        };
        let request = AgentRequest {
            method,
            path,
            token,
            remote: remote_ip,
            remote_mac: self.plane.neighbors.mac_of(remote_ip),
            segment: Segment(self.plane.neighbors.clone()),
            body,
        };
        let response = self.plane.inventory.agent(request).await;
        Response::builder()
            .status(response.status)
            .header(header::CONTENT_TYPE, response.content_type)
            .header(header::CACHE_CONTROL, "no-store")
            .body(full(response.body))
            .expect("valid response")
    }

    pub(super) fn report(&self, rest: &str, remote: SocketAddr) -> Response<Body> {
        let Some((mac, stage)) = rest.split_once('/') else {
            return text(StatusCode::NOT_FOUND, "expected /report/<mac>/<stage>\n");
        };
        let Ok(mac) = mac.parse::<MacAddr>() else {
            return text(StatusCode::BAD_REQUEST, "not a MAC address\n");
        };
        let valid = !stage.is_empty()
            && stage.len() <= 32
            && stage.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid {
            return text(StatusCode::BAD_REQUEST, "stage must be 1-32 of [a-z0-9-]\n");
        }
        // The rate first: it is cheap, and the holder check may read the ARP table.
        if !self.reports.lock().expect("report limiter lock").allow(remote.ip(), Instant::now()) {
            self.plane.metrics.http_refused(HttpRefusal::ReportRate);
            return text(StatusCode::TOO_MANY_REQUESTS, "too many reports from this address\n");
        }
        if self.mac_of(remote) != Some(mac) {
            self.plane.metrics.http_refused(HttpRefusal::ReportNotHolder);
            tracing::info!(%remote, %mac, stage, "refused a boot report from an address not holding the MAC");
            return text(
                StatusCode::FORBIDDEN,
                "reports are accepted only from the host holding the MAC\n",
            );
        }
        self.plane.timeline.record(mac, Stage::Report, format!("{stage} from {}", remote.ip()));
        text(StatusCode::OK, "recorded\n")
    }

    pub(super) fn timelines(&self) -> Response<Body> {
        let hosts = self.plane.timeline.hosts();
        let listed: Vec<String> =
            hosts.iter().take(MAX_LISTED_HOSTS).map(|m| m.to_string()).collect();
        json(&serde_json::json!({ "hosts": listed, "total": hosts.len() }))
    }

    pub(super) fn timeline(&self, mac: &str) -> Response<Body> {
        let Ok(mac) = mac.parse::<MacAddr>() else {
            return text(StatusCode::BAD_REQUEST, "not a MAC address\n");
        };
        json(&serde_json::json!({ "mac": mac, "events": self.plane.timeline.events(mac) }))
    }

    /// Whether `remote` is one of the site's hosts (its proven holder is a MAC the inventory
    /// knows) or this appliance itself: asked once per connection, at accept.
    pub(super) fn standing(&self, remote: SocketAddr) -> Standing {
        let own = ipv4(remote) == Some(self.plane.endpoints.address);
        Standing::of(own, if own { None } else { self.mac_of(remote) }, |mac| {
            self.plane.inventory.knows(mac)
        })
    }

    pub(super) fn mac_of(&self, remote: SocketAddr) -> Option<MacAddr> {
        match remote.ip() {
            std::net::IpAddr::V4(ip) => self.plane.neighbors.mac_of(ip),
            std::net::IpAddr::V6(ip) => {
                ip.to_ipv4_mapped().and_then(|ip: Ipv4Addr| self.plane.neighbors.mac_of(ip))
            }
        }
    }
}

/// A boot media key: exactly 64 lower-case hex digits.
pub(super) fn is_media_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

pub(super) fn ipv4(remote: SocketAddr) -> Option<Ipv4Addr> {
    match remote.ip() {
        std::net::IpAddr::V4(ip) => Some(ip),
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    }
}

/// What the timeline calls a download of a cached image.
pub(super) const IMAGE_STEP: &str = "/images/sha256/<digest>";

/// What a script's kernel command line carries that the timeline leaves out: the token (a
/// secret) and the operation's id, which stays behind the Kubernetes API.
pub(super) const REDACTED_ARGS: [&str; 2] = ["siteboot.token=", "siteboot.operation="];

/// What the timeline says about a script: its first command after the banner (without what
/// runs if it fails), with its token and operation redacted (the timeline is published to the
/// whole segment).
pub(super) fn describe_script(script: &str) -> String {
    let line = script
        .lines()
        .find(|l| !l.starts_with("#!") && !l.starts_with("echo") && !l.trim().is_empty())
        .map_or("(empty)", |l| l.split(" || ").next().unwrap_or(l));
    let redacted: Vec<String> = line
        .split(' ')
        .map(|w| match REDACTED_ARGS.iter().find(|arg| w.starts_with(*arg)) {
            Some(arg) => format!("{arg}<redacted>"),
            None => w.to_owned(),
        })
        .collect();
    redacted.join(" ").chars().take(300).collect()
}

/// Decodes `%XX` escapes; `None` for a malformed escape or a result that is not UTF-8.
pub(super) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn script_descriptions_redact_tokens_and_operations() {
        let script = "#!ipxe\necho hi\n\
            kernel http://h/k siteboot.token=s3cret siteboot.operation=0a1b quiet || goto a2\nboot\n";
        assert_eq!(
            describe_script(script),
            "kernel http://h/k siteboot.token=<redacted> siteboot.operation=<redacted> quiet"
        );
    }

    #[test]
    pub(super) fn percent_decoding() {
        assert_eq!(percent_decode("a%20b/c").as_deref(), Some("a b/c"));
        assert_eq!(percent_decode("%2e%2e/x").as_deref(), Some("../x"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
