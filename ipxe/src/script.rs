//! iPXE script building.
//!
//! iPXE reads a script line by line, splits each line on whitespace, expands `${setting}`
//! anywhere, treats `#` lines as comments and `:name` lines as labels, treats the tokens `||` and
//! `&&` as command separators, and parses tokens starting with `-` as options of the command. A
//! string that could do any of that is rejected when a [`Word`] is made, so it can never reach a
//! script.

use std::fmt;

/// How many times [`Script::boot_linux`] tries to fetch and boot.
pub const BOOT_ATTEMPTS: u32 = 4;
/// How long it waits between two tries.
pub const BOOT_RETRY_PAUSE_SECS: u32 = 5;

/// One token of an iPXE command line that iPXE passes through unchanged.
///
/// Invariant: non-empty, printable ASCII only, none of whitespace `$ { } # " ' \`, not `||` or
/// `&&`, and not starting with `-` or `:`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Word(String);

/// Why a string cannot be a [`Word`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsafeWord {
    #[error("is empty")]
    Empty,
    #[error("contains {0:?}, which iPXE would treat specially")]
    SpecialCharacter(char),
    #[error("contains a space or control character, which would split or end the iPXE command")]
    WhitespaceOrControl,
    #[error("contains the non-ASCII character {0:?}")]
    NonAscii(char),
    #[error("is {0:?}, which iPXE treats as a command separator")]
    Separator(String),
    #[error("starts with {0:?}, which iPXE would parse as an option or label")]
    LeadingCharacter(char),
}

impl Word {
    pub fn new(s: &str) -> Result<Self, UnsafeWord> {
        let first = s.chars().next().ok_or(UnsafeWord::Empty)?;
        if first == '-' || first == ':' {
            return Err(UnsafeWord::LeadingCharacter(first));
        }
        if s == "||" || s == "&&" {
            return Err(UnsafeWord::Separator(s.to_owned()));
        }
        for c in s.chars() {
            match c {
                '$' | '{' | '}' | '#' | '"' | '\'' | '\\' => {
                    return Err(UnsafeWord::SpecialCharacter(c));
                }
                c if !c.is_ascii() => return Err(UnsafeWord::NonAscii(c)),
                c if c.is_ascii_whitespace() || c.is_ascii_control() => {
                    return Err(UnsafeWord::WhitespaceOrControl);
                }
                _ => {}
            }
        }
        Ok(Self(s.to_owned()))
    }

    /// Makes a URL a `Word` by percent-encoding every byte iPXE could treat specially (and
    /// every non-ASCII byte). Existing `%XX` escapes are kept, so an already encoded URL is
    /// unchanged.
    pub fn url(s: &str) -> Result<Self, UnsafeWord> {
        let mut out = String::with_capacity(s.len());
        for (i, b) in s.bytes().enumerate() {
            let plain = b.is_ascii_alphanumeric()
                || b"._~/?=&,+@%!*;[]".contains(&b)
                || (i > 0 && b"-:".contains(&b));
            if plain {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        if out == "&&" {
            out = "%26%26".to_owned();
        }
        Self::new(&out)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Word {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An iPXE script under construction. Only commands siteboot needs exist, and every argument is a
/// [`Word`].
#[derive(Debug, Clone)]
pub struct Script {
    text: String,
}

impl Default for Script {
    fn default() -> Self {
        Self::new()
    }
}

impl Script {
    pub fn new() -> Self {
        Self { text: String::from("#!ipxe\n") }
    }

    fn line(&mut self, command: &str, args: &[&Word]) -> &mut Self {
        self.text.push_str(command);
        for arg in args {
            self.text.push(' ');
            self.text.push_str(arg.as_str());
        }
        self.text.push('\n');
        self
    }

    /// `echo` a message made of words.
    pub fn echo(&mut self, words: &[Word]) -> &mut Self {
        let args: Vec<&Word> = words.iter().collect();
        self.line("echo", &args)
    }

    /// Fetches `kernel` (its command line `args`) and each `(url, name)` of `initrds`, and boots
    /// them. A failed fetch or boot is tried again, [`BOOT_ATTEMPTS`] times in all and
    /// [`BOOT_RETRY_PAUSE_SECS`] apart, with what was fetched freed: an appliance restarted
    /// while the host fetched (an upgrade, a crash) serves again within seconds, and without
    /// the retry the firmware would go on to its next boot entry (the old OS on the disk) with
    /// the operation's token spent. Then `exit 1`, as a script that cannot boot does.
    ///
    /// `initrd --name NAME URL`: the name is what `initrd=NAME` on a UEFI kernel command line
    /// refers to.
    pub fn boot_linux(
        &mut self,
        kernel: &Word,
        args: &[Word],
        initrds: &[(Word, Word)],
    ) -> &mut Self {
        let label = |attempt: u32| match attempt {
            BOOT_ATTEMPTS => "siteboot-give-up".to_owned(),
            n => format!("siteboot-attempt-{}", n + 1),
        };
        for attempt in 0..BOOT_ATTEMPTS {
            if attempt > 0 {
                self.text.push_str(&format!(
                    ":{}\nimgfree\necho siteboot: the boot failed; trying again in {BOOT_RETRY_PAUSE_SECS} s\nsleep {BOOT_RETRY_PAUSE_SECS}\n",
                    label(attempt)
                ));
            }
            let or_else = format!(" || goto {}\n", label(attempt + 1));
            self.text.push_str("kernel ");
            self.text.push_str(kernel.as_str());
            for arg in args {
                self.text.push(' ');
                self.text.push_str(arg.as_str());
            }
            self.text.push_str(&or_else);
            for (url, name) in initrds {
                self.text.push_str(&format!("initrd --name {name} {url}{or_else}"));
            }
            self.text.push_str(&format!("boot{or_else}"));
        }
        self.text.push_str(&format!(
            ":{}\necho siteboot: the boot failed {BOOT_ATTEMPTS} times; giving up\n",
            label(BOOT_ATTEMPTS)
        ));
        self.exit()
    }

    /// `exit 1`: return to the firmware, which tries its next boot entry (usually the local
    /// disk). A failure status: UEFI firmware that gets success back from a boot option stops
    /// at its boot menu instead (UEFI spec, boot manager); a BIOS goes on either way.
    pub fn exit(&mut self) -> &mut Self {
        self.line("exit 1", &[])
    }

    /// Boot the first local disk through the BIOS/UEFI SAN interface.
    pub fn sanboot_local_disk(&mut self) -> &mut Self {
        self.line("sanboot --no-describe --drive 0x80", &[])
    }

    pub fn render(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_words_pass() {
        for s in ["console=ttyS0,115200n8", "http://10.0.0.1:8080/files/vmlinuz", "ro", "a&b"] {
            assert_eq!(Word::new(s).unwrap().as_str(), s);
        }
    }

    #[test]
    fn injection_attempts_are_rejected() {
        let cases = [
            ("", UnsafeWord::Empty),
            ("a b", UnsafeWord::WhitespaceOrControl),
            ("a\nshell", UnsafeWord::WhitespaceOrControl),
            ("x\r", UnsafeWord::WhitespaceOrControl),
            ("${root-path}", UnsafeWord::SpecialCharacter('$')),
            ("#comment", UnsafeWord::SpecialCharacter('#')),
            ("||", UnsafeWord::Separator("||".into())),
            ("&&", UnsafeWord::Separator("&&".into())),
            ("--name", UnsafeWord::LeadingCharacter('-')),
            (":label", UnsafeWord::LeadingCharacter(':')),
            ("quote\"", UnsafeWord::SpecialCharacter('"')),
            ("caf\u{e9}", UnsafeWord::NonAscii('\u{e9}')),
        ];
        for (input, expected) in cases {
            assert_eq!(Word::new(input), Err(expected), "input {input:?}");
        }
    }

    #[test]
    fn url_encoding_makes_anything_a_single_safe_word() {
        let hostile = "http://h/a b\n${x}||#\"'\\é";
        let word = Word::url(hostile).unwrap();
        assert_eq!(word.as_str(), "http://h/a%20b%0A%24%7Bx%7D%7C%7C%23%22%27%5C%C3%A9");
        assert_eq!(Word::url("-x").unwrap().as_str(), "%2Dx");
        assert_eq!(Word::url("&&").unwrap().as_str(), "%26%26");
        assert_eq!(Word::url("http://h/a%20b").unwrap().as_str(), "http://h/a%20b");
        assert_eq!(Word::url(""), Err(UnsafeWord::Empty));
    }

    #[test]
    fn a_linux_boot_is_tried_again_and_then_given_up() {
        let word = |w: &str| Word::new(w).unwrap();
        let mut script = Script::new();
        let initrds = [(word("http://h/i"), word("initrd.img"))];
        script.boot_linux(
            &word("http://h/k"),
            &[word("initrd=initrd.img"), word("quiet")],
            &initrds,
        );
        let attempt = |or_else: &str| {
            format!(
                "kernel http://h/k initrd=initrd.img quiet || goto {or_else}\n\
                 initrd --name initrd.img http://h/i || goto {or_else}\n\
                 boot || goto {or_else}\n"
            )
        };
        let again = |n: u32| {
            format!(
                ":siteboot-attempt-{n}\nimgfree\necho siteboot: the boot failed; trying again in 5 s\nsleep 5\n"
            )
        };
        let expected = [
            "#!ipxe\n".to_owned(),
            attempt("siteboot-attempt-2"),
            again(2),
            attempt("siteboot-attempt-3"),
            again(3),
            attempt("siteboot-attempt-4"),
            again(4),
            attempt("siteboot-give-up"),
            ":siteboot-give-up\necho siteboot: the boot failed 4 times; giving up\nexit 1\n"
                .to_owned(),
        ]
        .concat();
        assert_eq!(script.render(), expected);
    }
}
