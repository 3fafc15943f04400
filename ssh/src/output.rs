//! What a command printed, kept up to a cap: a server (or a command gone wrong) can print
//! without end, and the caller holds it in memory. Past the cap the bytes are counted and
//! dropped, and the capture says it was cut.

/// How much of each of stdout and stderr a command's [`Output`](crate::Output) keeps.
pub const CAPTURE_LIMIT: usize = 1024 * 1024;

/// One stream of a command's output: its first bytes, up to a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    bytes: Vec<u8>,
    /// How many bytes the stream carried in all, kept or not.
    total: u64,
    limit: usize,
}

impl Captured {
    pub(crate) fn new(limit: usize) -> Self {
        Self { bytes: Vec::new(), total: 0, limit }
    }

    /// `data`, captured as a command's stream would be: what a stand-in for a server (a test's)
    /// answers.
    pub fn of(data: &[u8]) -> Self {
        let mut captured = Self::new(CAPTURE_LIMIT);
        captured.push(data);
        captured
    }

    pub(crate) fn push(&mut self, data: &[u8]) {
        self.total += data.len() as u64;
        let room = self.limit.saturating_sub(self.bytes.len());
        self.bytes.extend_from_slice(&data[..data.len().min(room)]);
    }

    /// The bytes kept: all of them unless [`Captured::truncated`].
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The bytes kept, lossily decoded.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// Whether the stream carried more than was kept.
    pub fn truncated(&self) -> bool {
        self.total > self.bytes.len() as u64
    }

    /// How many bytes the stream carried, kept or not.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_kept_up_to_the_limit_and_the_rest_counted() {
        let mut captured = Captured::new(5);
        captured.push(b"abc");
        assert_eq!((captured.bytes(), captured.truncated()), (&b"abc"[..], false));
        captured.push(b"de");
        assert_eq!((captured.bytes(), captured.truncated()), (&b"abcde"[..], false));
        captured.push(b"fgh");
        captured.push(b"");
        captured.push(b"ij");
        assert_eq!(captured.bytes(), b"abcde");
        assert!(captured.truncated());
        assert_eq!(captured.total(), 10);
        assert_eq!(captured.text(), "abcde");
    }

    #[test]
    fn a_chunk_straddling_the_limit_is_cut_at_it() {
        let mut captured = Captured::new(4);
        captured.push(b"abcdef");
        assert_eq!(
            (captured.bytes(), captured.truncated(), captured.total()),
            (&b"abcd"[..], true, 6)
        );
    }
}
