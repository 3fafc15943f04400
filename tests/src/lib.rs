//! Test harness for siteboot.
//!
//! Everything here drives real programs: the `siteboot` binary, QEMU with real firmware, real DHCP
//! clients, and (in [`kube`]) a real kube-apiserver, etcd and the upstream Cluster API controllers.
//! Every wait has a deadline, every process and namespace is cleaned up on drop (also when a test
//! panics), and the logs of every process are printed when a test fails.

pub mod admission;
pub mod appliance;
pub mod attack;
pub mod bench;
pub mod browser;
pub mod clients;
pub mod failure;
pub mod forward;
pub mod initramfs;
pub mod kube;
pub mod netns;
pub mod os_images;
pub mod process;
pub mod provider;
pub mod redfish;
pub mod sim;
pub mod sshd;
pub mod timeline;
pub mod tls;
pub mod venv;
pub mod vm;
pub mod wait;
