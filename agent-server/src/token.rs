//! Per-operation tokens: minted when a host boots into the ramdisk, put on its kernel command
//! line, and checked on every agent request. Only the SHA-256 of a token is ever stored.

use rand::RngCore;
use sha2::{Digest, Sha256};
use siteboot_boot::BootAction;
use siteboot_boot::inventory::LinuxBoot;
use siteboot_ipxe::Word;

/// A fresh random token: 32 bytes, hex. Returns the token and its hash.
pub fn mint() -> (String, String) {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let token = hex::encode(bytes);
    let hash = hash(&token);
    (token, hash)
}

/// A fresh operation id: 16 random hex digits.
pub fn operation_id() -> String {
    mint().0[..16].to_owned()
}

/// A fresh virtual-media key: the last part of the media's URL (`/media/<key>.iso`), 32
/// random bytes, hex. Returns the key and the hash of the token it stands for
/// ([`media_token`]): only whoever can read the URL (the BMC it is inserted into) has the token.
pub fn mint_media_key() -> (String, String) {
    let (key, _) = mint();
    let hash = hash(&media_token(&key));
    (key, hash)
}

/// The token a virtual-media key stands for: the same token for every fetch of that media (a
/// BMC may fetch it again, or in ranges), and no other URL yields it.
pub fn media_token(key: &str) -> String {
    hash(&format!("siteboot virtual media {key}"))
}

pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Whether `token` hashes to `expected_hash`, comparing in constant time.
pub fn matches(token: &str, expected_hash: &str) -> bool {
    let actual = hash(token);
    actual.len() == expected_hash.len()
        && actual.bytes().zip(expected_hash.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The deploy ramdisk `ramdisk` booted for an operation: with the token issued for this boot
/// and the operation's id on its kernel command line (`siteboot.token=`,
/// `siteboot.operation=`), or with none (it then asks for its task and is told to wait).
pub fn ramdisk_boot(ramdisk: &LinuxBoot, issued: Option<(&str, &str)>) -> BootAction {
    let mut linux = ramdisk.clone();
    if let Some((token, operation)) = issued {
        linux.cmdline.extend(operation_words(token, operation));
    }
    BootAction::Linux(linux)
}

/// The words that give a ramdisk its operation: `siteboot.token=` and `siteboot.operation=`.
pub fn operation_words(token: &str, operation: &str) -> [Word; 2] {
    [format!("siteboot.token={token}"), format!("siteboot.operation={operation}")]
        .map(|arg| Word::new(&arg).expect("tokens and operation ids are hex"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_only_their_hash_matches() {
        let (a, ha) = mint();
        let (b, hb) = mint();
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(matches(&a, &ha));
        assert!(!matches(&a, &hb));
        assert!(!matches(&ha, &ha), "the hash is not a token");
        assert!(!matches("", &ha));
    }

    #[test]
    fn a_media_key_stands_for_one_token_that_is_not_the_key() {
        let (key, hash) = mint_media_key();
        let token = media_token(&key);
        assert_eq!(token, media_token(&key), "every fetch of the media carries one token");
        assert!(matches(&token, &hash));
        assert!(!matches(&key, &hash), "the key is not the token");
        assert_ne!(mint_media_key().0, key);
    }
}
