//! A port inside a network namespace that leads to a loopback port outside it: the appliance
//! under test (and the lab's VMs) run in a lab namespace, the kube-apiserver on the test
//! machine's loopback. Traffic stays in the namespace and on the machine's loopback.
//!
//! The listening socket is made in the namespace ([`Netns::enter`]); connections to the target
//! are made from the test process's own namespace.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use anyhow::Result;

use crate::netns::Netns;

/// Forwards `127.0.0.1:<port>` in a namespace to `127.0.0.1:<target>` outside; stops on drop.
pub struct LoopbackForward {
    port: u16,
    stop: Arc<AtomicBool>,
    ns_listener: Arc<TcpListener>,
}

impl LoopbackForward {
    pub fn start(ns: &Netns, target: u16) -> Result<Self> {
        Self::start_on(ns, 0, target)
    }

    /// Listens on `port` in the namespace's loopback (0: any free port). The same port as
    /// `target` makes one URL (`https://127.0.0.1:<target>`) work inside the namespace and
    /// outside it.
    pub fn start_on(ns: &Netns, port: u16, target: u16) -> Result<Self> {
        Self::start_at(ns, SocketAddrV4::new(Ipv4Addr::LOCALHOST, port), target)
    }

    /// Listens on `address` in the namespace: with the unspecified address, also where the
    /// namespace's bridges are, for the lab's VMs.
    pub fn start_at(ns: &Netns, address: SocketAddrV4, target: u16) -> Result<Self> {
        let listener = Arc::new(ns.enter(move || Ok(TcpListener::bind(address)?))?);
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let (accepting, stopping) = (listener.clone(), stop.clone());
        thread::spawn(move || {
            for conn in accepting.incoming() {
                if stopping.load(Ordering::Acquire) {
                    break;
                }
                let Ok(inner) = conn else { continue };
                let Ok(outer) = TcpStream::connect(SocketAddrV4::new(Ipv4Addr::LOCALHOST, target))
                else {
                    let _ = inner.shutdown(Shutdown::Both);
                    continue;
                };
                pipe(inner, outer);
            }
        });
        Ok(Self { port, stop, ns_listener: listener })
    }

    /// The port to use inside the namespace.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for LoopbackForward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop; the socket closes with its last reference.
        unsafe { libc::shutdown(self.ns_listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// Copies both ways until either side closes.
fn pipe(a: TcpStream, b: TcpStream) {
    let (a2, b2) = (a.try_clone(), b.try_clone());
    let (Ok(a2), Ok(b2)) = (a2, b2) else { return };
    thread::spawn(move || copy(a, b2));
    thread::spawn(move || copy(b, a2));
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
