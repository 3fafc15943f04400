//! Which handler answers a request: by port, method and path (the table in the module
//! documentation of [`super`]), with the reserve kept for what starts a boot.

use super::*;

impl HttpServer {
    pub(super) async fn route(
        &self,
        req: Request<Incoming>,
        remote: SocketAddr,
        port: Port,
        chunks: Option<Arc<FileChunks>>,
        slot: Slot,
    ) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let method = req.method().clone();
        let head = method == Method::HEAD;
        let segments: Vec<&str> = path.trim_start_matches('/').splitn(2, '/').collect();
        // A reserved slot is for what starts a boot: short answers, so the reserve frees fast.
        if slot == Slot::Reserved && !matches!(segments[0], "boot" | "ipxe" | "healthz" | "readyz")
        {
            self.plane.metrics.http_refused(HttpRefusal::ReservedSlot);
            let mut busy = text(StatusCode::SERVICE_UNAVAILABLE, "server busy, try again\n");
            busy.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
            return closing(busy);
        }
        let (route, response) = match (port, &method, segments.as_slice()) {
            (Port::Https, _, ["agent", rest]) => {
                let rest = (*rest).to_owned();
                (HttpRoute::Agent, self.agent(req, rest, remote).await)
            }
            (Port::Https, &Method::GET | &Method::HEAD, ["media", file]) => {
                (HttpRoute::Media, self.media(file, &req, head, remote).await)
            }
            (Port::Https, _, _) => (
                HttpRoute::NotFound,
                text(
                    StatusCode::NOT_FOUND,
                    "this port serves the agent API (/agent/) and boot media (/media/) only\n",
                ),
            ),
            // Before any of the request is read: the client has already sent its token in
            // clear, but it gets nothing in clear back, and learns where to go.
            (Port::Http, _, ["agent", ..]) => {
                self.plane.metrics.http_refused(HttpRefusal::AgentOverHttp);
                tracing::info!(%remote, path, "refused the agent API over plain HTTP");
                let message = format!(
                    "the agent API is served over HTTPS only: {}/agent/\n",
                    self.agent.base_url()
                );
                (HttpRoute::Agent, closing(text(StatusCode::FORBIDDEN, &message)))
            }
            // The key has crossed the segment in clear, but nothing else will.
            (Port::Http, _, ["media", ..]) => {
                self.plane.metrics.http_refused(HttpRefusal::MediaOverHttp);
                tracing::info!(%remote, "refused the boot media over plain HTTP");
                let message = format!(
                    "boot media is served over HTTPS only: {}/media/\n",
                    self.agent.base_url()
                );
                (HttpRoute::Media, text(StatusCode::FORBIDDEN, &message))
            }
            (Port::Http, &Method::GET, ["healthz"]) => {
                (HttpRoute::Health, text(StatusCode::OK, "ok\n"))
            }
            (Port::Http, &Method::GET, ["readyz"]) => (HttpRoute::Ready, self.readiness()),
            (Port::Http, &Method::GET, ["metrics"]) => (HttpRoute::Metrics, self.metrics_page()),
            (Port::Http, &Method::GET, ["boot", file]) => {
                (HttpRoute::Script, self.script(file, remote).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["files", rest]) => {
                let request = FileRequest { req: &req, head, remote, chunks };
                (HttpRoute::File, self.file(rest, request).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["images", rest]) => {
                let request = FileRequest { req: &req, head, remote, chunks };
                (HttpRoute::Image, self.image(rest, request).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["ipxe", name]) => {
                let request = FileRequest { req: &req, head, remote, chunks };
                (HttpRoute::IpxeBinary, self.ipxe_binary(name, request).await)
            }
            (Port::Http, &Method::POST, ["report", rest]) => {
                (HttpRoute::Report, self.report(rest, remote))
            }
            (Port::Http, &Method::GET, ["timeline"]) => (HttpRoute::Timeline, self.timelines()),
            (Port::Http, &Method::GET, ["timeline", mac]) => {
                (HttpRoute::Timeline, self.timeline(mac))
            }
            (Port::Http, &Method::GET, [""] | ["status", _]) => match &self.status {
                Some(page) => page.respond(&self.plane, &path, remote.ip()),
                None => (
                    HttpRoute::NotFound,
                    text(StatusCode::NOT_FOUND, "the status page is off (http.status_page)\n"),
                ),
            },
            (Port::Http, _, _) => (HttpRoute::NotFound, text(StatusCode::NOT_FOUND, "not found\n")),
        };
        self.plane.metrics.http_request(route);
        // A media key is a secret: whoever has it gets a token.
        let path = if segments[0] == "media" { "/media/<key>" } else { path.as_str() };
        tracing::debug!(%remote, ?port, %method, path, status = response.status().as_u16(), "HTTP request");
        response
    }
}
