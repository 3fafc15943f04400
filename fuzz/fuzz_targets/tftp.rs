//! Arbitrary bytes as a TFTP request and a stream of client packets, through parsing, option
//! negotiation and the transfer state machine. Checks the invariants a client relies on.

#![no_main]

use libfuzzer_sys::fuzz_target;
use siteboot_boot::tftp::TftpSettings;
use siteboot_boot::tftp::packet::{self, Packet};
use siteboot_boot::tftp::transfer::{self, Send, Transfer};

fuzz_target!(|data: &[u8]| {
    let limits = TftpSettings::default().limits();
    let (request, acks) = data.split_at(data.len().min(512));
    let options = match packet::parse(request) {
        Ok(Packet::Request(req)) => req.options,
        _ => Vec::new(),
    };
    let size = u64::from(u16::from_le_bytes([data.first().copied().unwrap_or(0), 0x10])) * 37;
    let negotiated = transfer::negotiate(&options, size, &limits);
    assert!(negotiated.block_size >= 8 && negotiated.block_size <= limits.max_block_size.max(512));
    assert!(negotiated.window_size >= 1 && negotiated.window_size <= limits.max_window_size);
    let mut t = Transfer::new(size, &negotiated, &limits);
    let mut send = t.start();
    for chunk in acks.chunks(3) {
        if let Send::Blocks { first, last } = send {
            assert!(first <= last && last - first < u64::from(negotiated.window_size));
            let (_, len) = t.block_range(last, size);
            assert!(len <= negotiated.block_size as usize);
        }
        if matches!(send, Send::Done | Send::GiveUp) {
            break;
        }
        send = match chunk {
            [0, ..] => t.on_timeout(),
            [_, hi, lo] => t.on_ack(u16::from_be_bytes([*hi, *lo])),
            _ => t.on_timeout(),
        };
        let _ = packet::parse(chunk);
    }
});
