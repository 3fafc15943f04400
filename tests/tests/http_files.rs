//! The HTTP file server as a client sees it, with real curl: HEAD, byte ranges, ETag and
//! If-None-Match, and no path (dot-dot, encoded dot-dot, symlink) outside the HTTP root.
//!
//! Failures panic (`unwrap`) while siteboot is alive, so its log gets printed.

use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::netns::{self, Netns};

/// `curl` in the lab namespace: (status, headers lower-cased, body).
fn curl(ns: &Netns, args: &[&str], url: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (headers, body) = (dir.path().join("headers"), dir.path().join("body"));
    netns::run(
        ns.command("curl")
            .args(["-sS", "--path-as-is", "--max-time", "10", "-D"])
            .arg(&headers)
            .arg("-o")
            .arg(&body)
            .args(args)
            .arg(url),
    )
    .unwrap();
    let text = std::fs::read_to_string(&headers).unwrap();
    let mut lines = text.lines();
    let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, std::fs::read(&body).unwrap_or_default())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

#[test]
fn files_are_served_with_ranges_and_validators_and_nothing_outside_the_root() {
    let ns = appliance::lab_network("http").unwrap();
    let siteboot = Appliance::start(&ns, appliance::lab_config("off")).unwrap();
    let data: Vec<u8> = (0..1_048_576u32).map(|i| (i % 251) as u8).collect();
    let root = siteboot.http_root();
    std::fs::create_dir_all(root.join("images")).unwrap();
    std::fs::write(root.join("images/data.bin"), &data).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("escape")).unwrap();
    let url = |path: &str| format!("{}{path}", siteboot.base_url());

    let (status, headers, _) = curl(&ns, &["-I"], &url("/files/images/data.bin"));
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "content-length"), Some("1048576"));
    assert_eq!(header(&headers, "accept-ranges"), Some("bytes"));
    let etag = header(&headers, "etag").expect("an ETag").to_owned();
    assert!(header(&headers, "last-modified").is_some());

    let (status, _, body) = curl(&ns, &[], &url("/files/images/data.bin"));
    assert_eq!((status, body.len()), (200, data.len()));
    assert!(body == data, "the whole file, byte-exact");

    let (status, headers, body) = curl(&ns, &["-r", "100-199"], &url("/files/images/data.bin"));
    assert_eq!(status, 206);
    assert_eq!(header(&headers, "content-range"), Some("bytes 100-199/1048576"));
    assert_eq!(body, &data[100..200]);
    let (status, _, body) = curl(&ns, &["-H", "Range: bytes=-10"], &url("/files/images/data.bin"));
    assert_eq!((status, body.as_slice()), (206, &data[data.len() - 10..]));
    let (status, headers, _) =
        curl(&ns, &["-H", "Range: bytes=2000000-"], &url("/files/images/data.bin"));
    assert_eq!(status, 416);
    assert_eq!(header(&headers, "content-range"), Some("bytes */1048576"));
    // A stale If-Range: the whole file instead of the range.
    let (status, _, body) =
        curl(&ns, &["-r", "0-9", "-H", "If-Range: \"stale\""], &url("/files/images/data.bin"));
    assert_eq!((status, body.len()), (200, data.len()));

    let (status, _, body) =
        curl(&ns, &["-H", &format!("If-None-Match: {etag}")], &url("/files/images/data.bin"));
    assert_eq!((status, body.len()), (304, 0));

    for path in [
        "/files/../../etc/passwd",
        "/files/%2e%2e/%2e%2e/etc/passwd",
        "/files/escape",
        "/files/images/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    ] {
        let (status, _, body) = curl(&ns, &[], &url(path));
        assert!(status == 403 || status == 404, "{path}: {status}");
        assert!(
            !String::from_utf8_lossy(&body).contains("root:"),
            "{path} served a file outside the root"
        );
    }
    assert_eq!(curl(&ns, &[], &url("/files/images/missing")).0, 404);
    assert_eq!(curl(&ns, &[], &url("/files/images")).0, 404, "a directory is not a file");
    assert_eq!(
        curl(&ns, &[], &url("/ipxe/undionly.kpxe")).0,
        200,
        "iPXE binaries for UEFI HTTP boot"
    );
    assert_eq!(curl(&ns, &[], &url("/ipxe/..%2f..%2fetc%2fpasswd")).0, 404);

    let metrics = siteboot.metrics().unwrap();
    assert!(metrics.get("siteboot_http_bytes_total") >= (data.len() + 300) as f64);
    assert!(metrics.get(r#"siteboot_http_requests_total{route="file"}"#) >= 10.0);
}
