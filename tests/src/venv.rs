//! Python virtualenvs with pinned packages from PyPI, made with Debian's python3 (the
//! `python3-venv` package) once per machine under `$SITEBOOT_CACHE/<name>/`, where `name` says
//! the pinned versions: a new pin makes a new venv.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

use crate::netns;

/// Debian's Python, which the `python3-venv` package gives `venv`.
const PYTHON: &str = "/usr/bin/python3";

/// The python of the venv `name` with `requirements` (`package==version`) installed.
pub fn python_with(name: &str, requirements: &[String]) -> Result<PathBuf> {
    static MADE: Mutex<()> = Mutex::new(());
    let _made = MADE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = crate::initramfs::cache_dir().join(name);
    let python = dir.join("bin/python3");
    if python.exists() {
        return Ok(python);
    }
    // Made beside its final place and renamed: an interrupted run leaves no half-made venv.
    let parent = dir.parent().expect("cache dir has a parent");
    std::fs::create_dir_all(parent)?;
    let tmp = tempfile::Builder::new().prefix(&format!(".{name}-")).tempdir_in(parent)?;
    let venv = tmp.path().join("venv");
    netns::run(Command::new(PYTHON).args(["-m", "venv"]).arg(&venv)).with_context(|| {
        format!("making a virtualenv for {name} (is python3-venv installed? run scripts/setup)")
    })?;
    netns::run(
        Command::new(venv.join("bin/python3"))
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input"])
            .args(requirements),
    )
    .with_context(|| format!("installing {} from PyPI", requirements.join(" ")))?;
    if std::fs::rename(&venv, &dir).is_err() && !python.exists() {
        bail!("could not move the {name} virtualenv to {}", dir.display());
    }
    Ok(python)
}
