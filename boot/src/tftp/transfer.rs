//! One read transfer, with no I/O: option negotiation (RFC 2347/2348/2349/7440) and the
//! sliding-window state machine that decides which blocks to (re)send.
//!
//! Blocks are numbered 1.. internally as u64; on the wire they wrap from 65535 to 0, which is
//! what clients that support files over 32 MiB (at 512-byte blocks) expect. An ACK is mapped
//! back to the one outstanding block it can mean: the window is at most 65535 blocks wide.

use std::time::Duration;

/// The server's limits for what clients may negotiate.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_block_size: u16,
    pub max_window_size: u16,
    /// Retransmission timeout when the client asks for none (or for too long a one).
    pub default_timeout: Duration,
    /// Longest timeout a client may ask for: with its retries, what an abandoned transfer
    /// holds a slot for.
    pub max_timeout: Duration,
    /// Retransmissions of one window before giving up.
    pub max_retries: u32,
}

/// The parameters a transfer runs with, and the OACK that announces them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub block_size: u16,
    pub window_size: u16,
    pub timeout: Duration,
    /// Options acknowledged, in the client's order; empty means no OACK (plain RFC 1350).
    pub oack: Vec<(&'static str, String)>,
}

/// Negotiates the options of a read request for a file of `file_size` bytes. Unknown options
/// and invalid values are ignored, as RFC 2347 allows.
pub fn negotiate(options: &[(&str, &str)], file_size: u64, limits: &Limits) -> Negotiated {
    let mut n = Negotiated {
        block_size: 512,
        window_size: 1,
        timeout: limits.default_timeout,
        oack: Vec::new(),
    };
    for (name, value) in options {
        let name = name.to_ascii_lowercase();
        match name.as_str() {
            "blksize" => {
                if let Some(v) = value.parse::<u32>().ok().filter(|v| (8..=65464).contains(v)) {
                    n.block_size = v.min(u32::from(limits.max_block_size)) as u16;
                    n.oack.push(("blksize", n.block_size.to_string()));
                }
            }
            "tsize" => n.oack.push(("tsize", file_size.to_string())),
            // RFC 2349: the OACK must echo the client's value, so a value over the cap is
            // refused by leaving the option out of the OACK, and our own timeout applies.
            "timeout" => {
                let asked = value.parse::<u8>().ok().map(|v| Duration::from_secs(u64::from(v)));
                if let Some(timeout) = asked.filter(|t| !t.is_zero() && *t <= limits.max_timeout) {
                    n.timeout = timeout;
                    n.oack.push(("timeout", timeout.as_secs().to_string()));
                }
            }
            "windowsize" => {
                if let Some(v) = value.parse::<u16>().ok().filter(|v| *v >= 1) {
                    n.window_size = v.min(limits.max_window_size.max(1));
                    n.oack.push(("windowsize", n.window_size.to_string()));
                }
            }
            _ => {}
        }
    }
    n
}

/// What the transfer wants sent next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Send {
    /// The OACK (the client answers with ACK 0).
    Oack,
    /// DATA blocks `first..=last` (internal numbers, from 1).
    Blocks { first: u64, last: u64 },
    /// Nothing now: wait for an ACK or the timeout.
    Nothing,
    /// The client acknowledged the last block.
    Done,
    /// Too many retransmissions without progress.
    GiveUp,
}

#[derive(Debug)]
pub struct Transfer {
    block_size: u64,
    window: u64,
    /// The final block: a short (possibly empty) block ends a TFTP transfer.
    last_block: u64,
    /// The highest block the client has acknowledged (0: none yet, or the OACK).
    acked: u64,
    /// The highest block sent so far.
    sent: u64,
    oack_pending: bool,
    retries: u32,
    max_retries: u32,
}

impl Transfer {
    pub fn new(file_size: u64, negotiated: &Negotiated, limits: &Limits) -> Self {
        let block_size = u64::from(negotiated.block_size);
        Self {
            block_size,
            window: u64::from(negotiated.window_size),
            last_block: file_size / block_size + 1,
            acked: 0,
            sent: 0,
            oack_pending: !negotiated.oack.is_empty(),
            retries: 0,
            max_retries: limits.max_retries,
        }
    }

    /// Byte offset and length of internal block `block` in a file of `file_size` bytes.
    pub fn block_range(&self, block: u64, file_size: u64) -> (u64, usize) {
        let offset = (block - 1) * self.block_size;
        let len = file_size.saturating_sub(offset).min(self.block_size);
        (offset, len as usize)
    }

    /// The wire number of internal block `block`.
    pub fn wire_block(block: u64) -> u16 {
        (block % 65_536) as u16
    }

    /// What to send first.
    pub fn start(&mut self) -> Send {
        if self.oack_pending { Send::Oack } else { self.next_window() }
    }

    fn next_window(&mut self) -> Send {
        if self.acked >= self.last_block {
            return Send::Done;
        }
        let first = self.acked + 1;
        let last = (self.acked + self.window).min(self.last_block);
        self.sent = self.sent.max(last);
        Send::Blocks { first, last }
    }

    /// The client acknowledged wire block `wire`.
    pub fn on_ack(&mut self, wire: u16) -> Send {
        if self.oack_pending {
            if wire != 0 {
                return Send::Nothing;
            }
            self.oack_pending = false;
            self.retries = 0;
            return self.next_window();
        }
        // The outstanding blocks are acked+1..=sent; find the one this ACK names.
        let Some(block) = (self.acked + 1..=self.sent).rev().find(|b| Self::wire_block(*b) == wire)
        else {
            // A duplicate or stale ACK: resending now would double traffic (Sorcerer's
            // Apprentice); the timeout covers real loss.
            return Send::Nothing;
        };
        self.acked = block;
        self.retries = 0;
        // After a partial ACK (part of the window was lost, RFC 7440) this resumes right after
        // the acknowledged block.
        self.next_window()
    }

    /// No ACK arrived in time: resend what is outstanding.
    pub fn on_timeout(&mut self) -> Send {
        self.retries += 1;
        if self.retries > self.max_retries {
            return Send::GiveUp;
        }
        if self.oack_pending { Send::Oack } else { self.next_window() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        crate::tftp::TftpSettings::default().limits()
    }

    #[test]
    fn negotiation_clamps_and_ignores_invalid() {
        let n = negotiate(
            &[
                ("BLKSIZE", "65464"),
                ("tsize", "0"),
                ("windowsize", "1000"),
                ("timeout", "3"),
                ("x", "y"),
            ],
            1234,
            &limits(),
        );
        assert_eq!((n.block_size, n.window_size, n.timeout), (1468, 64, Duration::from_secs(3)));
        assert_eq!(
            n.oack,
            vec![
                ("blksize", "1468".into()),
                ("tsize", "1234".into()),
                ("windowsize", "64".into()),
                ("timeout", "3".into())
            ]
        );
        let n = negotiate(
            &[("blksize", "7"), ("timeout", "0"), ("windowsize", "0"), ("blksize2", "1")],
            0,
            &limits(),
        );
        assert_eq!((n.block_size, n.window_size, n.oack.len()), (512, 1, 0));
        assert_eq!(negotiate(&[("blksize", "99999999999")], 0, &limits()).block_size, 512);
    }

    #[test]
    fn a_timeout_over_the_cap_is_not_acknowledged() {
        let limits = limits();
        let n = negotiate(&[("timeout", "255"), ("tsize", "0")], 7, &limits);
        assert_eq!(n.timeout, limits.default_timeout, "the server's default applies");
        assert_eq!(n.oack, vec![("tsize", "7".into())], "timeout left out of the OACK");
        let n = negotiate(&[("timeout", "11")], 7, &limits);
        assert_eq!((n.timeout, n.oack.len()), (limits.default_timeout, 0));
        let n = negotiate(&[("timeout", "10")], 7, &limits);
        assert_eq!(n.timeout, Duration::from_secs(10), "the cap itself is accepted");
        assert_eq!(n.oack, vec![("timeout", "10".into())], "and echoed unchanged");
    }

    fn plain(size: u64) -> (Transfer, Negotiated) {
        let n = negotiate(&[], size, &limits());
        (Transfer::new(size, &n, &limits()), n)
    }

    #[test]
    fn lockstep_without_options() {
        let (mut t, _) = plain(1024);
        assert_eq!(t.start(), Send::Blocks { first: 1, last: 1 });
        assert_eq!(t.on_ack(1), Send::Blocks { first: 2, last: 2 });
        assert_eq!(t.on_ack(1), Send::Nothing, "duplicate ACK does not resend");
        assert_eq!(
            t.on_ack(2),
            Send::Blocks { first: 3, last: 3 },
            "an exact multiple ends with an empty block"
        );
        assert_eq!(t.block_range(3, 1024), (1024, 0));
        assert_eq!(t.on_ack(3), Send::Done);
    }

    #[test]
    fn windows_slide_and_resume_after_a_partial_ack() {
        let n = negotiate(&[("windowsize", "4")], 512 * 10, &limits());
        let mut t = Transfer::new(512 * 10, &n, &limits());
        assert_eq!(t.start(), Send::Oack);
        assert_eq!(t.on_ack(5), Send::Nothing, "only ACK 0 answers an OACK");
        assert_eq!(t.on_ack(0), Send::Blocks { first: 1, last: 4 });
        assert_eq!(t.on_ack(2), Send::Blocks { first: 3, last: 6 }, "blocks 3-4 were lost");
        assert_eq!(t.on_ack(6), Send::Blocks { first: 7, last: 10 });
        assert_eq!(t.on_ack(10), Send::Blocks { first: 11, last: 11 });
        assert_eq!(t.on_ack(11), Send::Done);
    }

    #[test]
    fn timeouts_resend_then_give_up() {
        let (mut t, _) = plain(100);
        assert_eq!(t.start(), Send::Blocks { first: 1, last: 1 });
        for _ in 0..5 {
            assert_eq!(t.on_timeout(), Send::Blocks { first: 1, last: 1 });
        }
        assert_eq!(t.on_timeout(), Send::GiveUp);
    }

    #[test]
    fn block_numbers_wrap_past_65535() {
        let size = 512 * 70_000;
        let (mut t, _) = plain(size);
        let mut send = t.start();
        let mut sent_blocks = 0u64;
        while let Send::Blocks { first, last } = send {
            assert_eq!(first, last);
            sent_blocks += 1;
            send = t.on_ack(Transfer::wire_block(last));
        }
        assert_eq!(send, Send::Done);
        assert_eq!(sent_blocks, 70_001);
        assert_eq!(Transfer::wire_block(65_536), 0);
        assert_eq!(Transfer::wire_block(65_537), 1);
    }
}
