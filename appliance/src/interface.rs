//! The IPv4 addresses of a network interface, for an appliance whose config leaves `address`
//! to the machine it runs on (each replica of a site on its own node).

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;

/// Every IPv4 address of `interface` (none if it does not exist).
pub fn ipv4_addresses(interface: &str) -> io::Result<Vec<Ipv4Addr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list that freeifaddrs releases below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*entry };
        entry = ifa.ifa_next;
        // SAFETY: `ifa_name` is a NUL-terminated string of the node.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        if ifa.ifa_addr.is_null() || name.to_bytes() != interface.as_bytes() {
            continue;
        }
        // SAFETY: a non-null `ifa_addr` points to a sockaddr of the family it names.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a `sockaddr_in`.
        let v4 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        addresses.push(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)));
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    Ok(addresses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_interface_has_its_address() {
        assert!(ipv4_addresses("lo").unwrap().contains(&Ipv4Addr::LOCALHOST));
        assert!(ipv4_addresses("no-such-interface").unwrap().is_empty());
    }
}
