//! Bad input against the running server: a corpus of malformed DHCP and TFTP datagrams
//! (truncated, wrong lengths, option overload, huge option counts, bad opcodes, hostile file
//! names, abandoned transfers) is replayed at siteboot while real clients use it. siteboot must
//! answer or drop each one, never exit, keep serving the real clients, and keep its memory
//! bounded. A real TFTP client then fetches a file of more than 65535 blocks (block numbers
//! wrap) and gets every byte.
//!
//! Failures panic (`unwrap`) while the processes are alive, so their logs get printed.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::clients::{ClientHost, Udhcpc};
use siteboot_tests::netns;
use siteboot_tests::wait;

const SERVER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const ATTACKER: &str = "10.99.0.250";
/// 36 MiB: 73,728 blocks of 512 bytes, past the 16-bit block number.
const BIG_FILE_LEN: usize = 36 * 1024 * 1024;
const ROUNDS: usize = 20;

/// A BOOTREQUEST with the magic cookie and `options` (caller adds the end marker or not).
fn bootp(op: u8, hlen: u8, mac: [u8; 6], options: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 236];
    p[0] = op;
    p[1] = 1; // Ethernet
    p[2] = hlen;
    p[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    p[28..34].copy_from_slice(&mac);
    p.extend_from_slice(&[99, 130, 83, 99]);
    p.extend_from_slice(options);
    p
}

/// Tiny deterministic PRNG (xorshift) for the random part of the corpus.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn dhcp_corpus() -> Vec<Vec<u8>> {
    let mac = [0x52, 0x54, 0, 0, 0x0b, 0x02];
    let discover = bootp(1, 6, mac, &[53, 1, 1, 255]);
    let mut corpus = Vec::new();
    // Truncated at every length.
    for len in 0..discover.len() {
        corpus.push(discover[..len].to_vec());
    }
    // Hardware address lengths that do not fit (a naive chaddr slice panics at 17).
    for hlen in [0, 5, 7, 16, 17, 255] {
        corpus.push(bootp(1, hlen, mac, &[53, 1, 1, 255]));
    }
    // Bad opcodes and a missing magic cookie.
    for op in [0, 2, 3, 255] {
        corpus.push(bootp(op, 6, mac, &[53, 1, 1, 255]));
    }
    let mut no_magic = discover.clone();
    no_magic[236] = 0;
    corpus.push(no_magic);
    // Option lengths running past the datagram, zero-length and wrong-length options.
    corpus.push(bootp(1, 6, mac, &[53, 1, 1, 60, 200, b'P', b'X']));
    corpus.push(bootp(1, 6, mac, &[53, 0, 255]));
    corpus.push(bootp(
        1,
        6,
        mac,
        &[53, 4, 1, 1, 1, 1, 50, 2, 10, 99, 54, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255],
    ));
    corpus.push(bootp(
        1,
        6,
        mac,
        &[53, 1, 1, 93, 1, 0, 94, 1, 1, 152, 1, 0, 81, 1, 0, 121, 3, 33, 1, 1, 255],
    ));
    // Option overload (52) claiming options in sname/file, which hold garbage.
    let mut overload = bootp(1, 6, mac, &[53, 1, 1, 52, 1, 3, 255]);
    for b in &mut overload[44..236] {
        *b = 0xff;
    }
    corpus.push(overload);
    // Huge option counts: thousands of pads, hundreds of one-byte options, a jumbo datagram.
    let mut pads = vec![0u8; 8000];
    pads.extend_from_slice(&[53, 1, 1, 255]);
    corpus.push(bootp(1, 6, mac, &pads));
    let many: Vec<u8> = (0..600).flat_map(|i| [(i % 250 + 1) as u8, 1, 0]).chain([255]).collect();
    corpus.push(bootp(1, 6, mac, &many));
    let mut long_options = vec![53, 1, 1];
    for _ in 0..30 {
        long_options.extend_from_slice(&[60, 255]);
        long_options.extend(std::iter::repeat_n(b'A', 255));
    }
    long_options.push(255);
    corpus.push(bootp(1, 6, mac, &long_options));
    // Random garbage, with and without a valid header.
    let mut rng = Rng(0x5eed);
    for _ in 0..200 {
        let n = (rng.next() % 600) as usize;
        corpus.push(rng.bytes(n));
        let tail = rng.bytes(n);
        corpus.push(bootp(1, 6, mac, &tail));
    }
    corpus
}

fn tftp_corpus() -> Vec<Vec<u8>> {
    let mut corpus: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0, 9, b'x', 0],
        b"\x00\x01undionly.kpxe".to_vec(),
        b"\x00\x01undionly.kpxe\x00".to_vec(),
        b"\x00\x01undionly.kpxe\x00mail\x00".to_vec(),
        b"\x00\x02upload.bin\x00octet\x00".to_vec(),
        b"\x00\x01../../etc/passwd\x00octet\x00".to_vec(),
        b"\x00\x01/etc/passwd\x00octet\x00".to_vec(),
        b"\x00\x01\xff\xfe\x00octet\x00".to_vec(),
        b"\x00\x01undionly.kpxe\x00octet\x00blksize\x00".to_vec(),
        b"\x00\x01undionly.kpxe\x00octet\x00blksize\x00-1\x00tsize\x0099999999999999999999\x00"
            .to_vec(),
        b"\x00\x04\x00\x01".to_vec(),
        b"\x00\x03\x00\x01data".to_vec(),
        b"\x00\x05\x00\x01oops\x00".to_vec(),
    ];
    let mut options = b"\x00\x01undionly.kpxe\x00octet\x00".to_vec();
    for i in 0..200 {
        options.extend_from_slice(format!("opt{i}\x00{i}\x00").as_bytes());
    }
    corpus.push(options);
    let mut long_name = b"\x00\x01".to_vec();
    long_name.extend(std::iter::repeat_n(b'a', 2000));
    long_name.extend_from_slice(b"\x00octet\x00");
    corpus.push(long_name);
    corpus
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn malformed_packets_are_answered_or_dropped_without_harm() {
    let ns = appliance::lab_network("bad").unwrap();
    let tftp_root = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..BIG_FILE_LEN).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(tftp_root.path().join("big.img"), &big).unwrap();
    let mut config = appliance::lab_config("full");
    // One attacker address: its per-address cap is the global one, so that its abandoned
    // transfers below run into the global cap.
    config["tftp"] = json!({
        "root": tftp_root.path(),
        "max_transfers": 16,
        "max_transfers_per_address": 16,
    });
    let siteboot = Appliance::start(&ns, config).unwrap();
    let pid = siteboot.pid().unwrap();

    let attacker = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:0b:01").unwrap();
    attacker.ns.ip(&["addr", "add", &format!("{ATTACKER}/24"), "dev", ClientHost::IFACE]).unwrap();
    let bind = || -> anyhow::Result<UdpSocket> {
        let socket = UdpSocket::bind(SocketAddrV4::new(ATTACKER.parse()?, 0))?;
        socket.set_broadcast(true)?;
        Ok(socket)
    };
    let socket = attacker.ns.enter(bind).unwrap();
    let rss_before = rss_kib(pid);

    // A real client keeps working while the corpus is replayed.
    let client_host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:0b:03").unwrap();
    let mut client = Udhcpc::start(&client_host, &[]).unwrap();

    let dhcp = dhcp_corpus();
    let tftp = tftp_corpus();
    let targets = [
        SocketAddrV4::new(SERVER, 67),
        SocketAddrV4::new(Ipv4Addr::BROADCAST, 67),
        SocketAddrV4::new(SERVER, 4011),
    ];
    for _ in 0..ROUNDS {
        for packet in &dhcp {
            for target in targets {
                // A datagram too large for the link is refused locally: nothing to test there.
                let _ = socket.send_to(packet, target);
            }
        }
        for packet in &tftp {
            let _ = socket.send_to(packet, SocketAddrV4::new(SERVER, 69));
        }
    }
    let lease = client.wait_bound(Duration::from_secs(60)).unwrap();
    assert!(lease.address.is_some(), "a real client got a lease during the replay: {lease:?}");
    assert!(siteboot.exited().is_none(), "siteboot exited under malformed input");
    assert_eq!(siteboot.get("/healthz").unwrap().0, 200);
    let metrics = siteboot.metrics().unwrap();
    assert!(
        metrics.get("siteboot_dhcp_dropped_total") >= (dhcp.len() / 2) as f64,
        "drops are counted"
    );
    assert!(metrics.get("siteboot_tftp_requests_refused_total") > 0.0);

    // Abandoned transfers: more requests than the cap, from distinct ports, never acknowledged.
    let abandoned: Vec<UdpSocket> = (0..40).map(|_| attacker.ns.enter(bind).unwrap()).collect();
    for s in &abandoned {
        s.send_to(b"\x00\x01big.img\x00octet\x00", SocketAddrV4::new(SERVER, 69)).unwrap();
    }
    // They time out (5 retransmissions, 1 s apart) and free their slots.
    wait::for_("abandoned TFTP transfers to time out", Duration::from_secs(60), || {
        let m = siteboot.metrics().ok()?;
        (m.get("siteboot_tftp_transfers_active") == 0.0
            && m.get("siteboot_tftp_transfers_failed_total") >= 16.0)
            .then_some(())
    })
    .unwrap();
    drop(abandoned);

    // Block numbers wrap: a real client with windowsize fetches all 73,728 blocks intact.
    let out = attacker.dir().join("big.img");
    netns::run(attacker.ns.command("atftp").args([
        "--option",
        "windowsize 16",
        "--get",
        "-r",
        "big.img",
        "-l",
        out.to_str().unwrap(),
        &SERVER.to_string(),
    ]))
    .unwrap();
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), BIG_FILE_LEN);
    assert_eq!(Sha256::digest(&got), Sha256::digest(&big), "the wrapped transfer is byte-exact");

    let rss_after = rss_kib(pid);
    assert!(
        rss_after < rss_before + 64 * 1024,
        "memory grew from {rss_before} KiB to {rss_after} KiB under malformed input"
    );
    assert!(siteboot.exited().is_none());
}
