use sha2::{Digest as _, Sha256};

use crate::Digest;

/// Hashes an image as it streams past, to be checked against the digest it must have once
/// the last byte is through.
#[derive(Clone, Default)]
pub struct Verifier {
    hasher: Sha256,
    bytes: u64,
}

/// The image that went through is not the one named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {bytes} bytes received hash to {actual}, not the expected {expected}")]
pub struct Mismatch {
    pub expected: Digest,
    pub actual: Digest,
    pub bytes: u64,
}

impl Verifier {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.bytes += data.len() as u64;
    }

    /// Bytes hashed so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The digest of everything that went through.
    pub fn finish(self) -> Digest {
        Digest::from_bytes(self.hasher.finalize().into())
    }

    /// Ok if everything that went through has the digest `expected`.
    pub fn check(self, expected: &Digest) -> Result<(), Mismatch> {
        let bytes = self.bytes;
        let actual = self.finish();
        if actual == *expected {
            Ok(())
        } else {
            Err(Mismatch { expected: *expected, actual, bytes })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_does_not_matter() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut whole = Verifier::new();
        whole.update(&data);
        let expected = whole.finish();
        let mut chunked = Verifier::new();
        for chunk in data.chunks(333) {
            chunked.update(chunk);
        }
        assert_eq!(chunked.bytes(), 10_000);
        assert_eq!(chunked.check(&expected), Ok(()));
    }

    #[test]
    fn known_digest_and_mismatch() {
        let abc: Digest = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            .parse()
            .unwrap();
        let mut v = Verifier::new();
        v.update(b"abc");
        assert_eq!(v.clone().check(&abc), Ok(()));
        v.update(b"d");
        let e = v.check(&abc).unwrap_err();
        assert_eq!((e.expected, e.bytes), (abc, 4));
        assert_ne!(e.actual, abc);
    }
}
