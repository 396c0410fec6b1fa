//! Silent network cuts on loopback with nftables (infra.md §8): packets are dropped in the kernel, so
//! an open connection gets no reply and a new connect hangs, exactly like a partition. After
//! [`heal`](LoopbackCut::heal) TCP retransmits what was queued (after long cuts its backoff can stretch
//! that to seconds).
//!
//! Each [`LoopbackCut`] owns one nftables table, `inet distlock_<pid>_<n>`, with one output chain on
//! `lo` that drops TCP to *and* from the cut ports and every packet to or from the cut 127.0.0.x
//! addresses (both directions leave through `lo`'s output hook). Dropping the handle deletes the table;
//! tables of test processes that died without dropping theirs are deleted by the next `new()`.
//!
//! Root only (`CAP_NET_ADMIN`) and needs the `nft` tool: without them [`LoopbackCut::new`] fails with an
//! error naming the fix. Tests never skip.

use std::io::{self, Write as _};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};

/// The nftables tool.
pub const NFT: &str = "nft";
/// Shown when it is missing.
pub const NFT_INSTALL_HINT: &str =
    "install it with `apt-get install -y nftables` (or run scripts/setup.sh)";
/// Prefix of every table this module creates.
const TABLE_PREFIX: &str = "distlock_";

/// An nftables table that drops loopback traffic of chosen ports and addresses; deleted on drop.
#[derive(Debug)]
pub struct LoopbackCut {
    table: String,
    ports: Vec<u16>,
    addrs: Vec<Ipv4Addr>,
}

impl LoopbackCut {
    /// Creates an empty table (nothing is cut yet). Fails without root or without `nft`.
    pub fn new() -> Result<LoopbackCut> {
        if !rustix::process::geteuid().is_root() {
            return Err(Error::State(
                "nftables loopback cuts need root (CAP_NET_ADMIN); run the tests as root \
                 (e.g. `sudo -E cargo nextest run`), as CI does"
                    .to_owned(),
            ));
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        sweep_dead_tables();
        let table = format!(
            "{TABLE_PREFIX}{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let script = format!(
            "table inet {table} {{\n\
               set ports {{ type inet_service; }}\n\
               set addrs {{ type ipv4_addr; }}\n\
               chain out {{\n\
                 type filter hook output priority 0; policy accept;\n\
                 oifname \"lo\" tcp dport @ports drop\n\
                 oifname \"lo\" tcp sport @ports drop\n\
                 oifname \"lo\" ip daddr @addrs drop\n\
                 oifname \"lo\" ip saddr @addrs drop\n\
               }}\n\
             }}\n"
        );
        nft_script(&script)?;
        tracing::debug!(%table, "nftables table created");
        Ok(LoopbackCut {
            table,
            ports: Vec::new(),
            addrs: Vec::new(),
        })
    }

    /// [`new`](Self::new), panicking with the reason. For tests.
    pub fn new_or_panic() -> LoopbackCut {
        match Self::new() {
            Ok(c) => c,
            Err(e) => panic!("creating a loopback cut failed: {e}"),
        }
    }

    /// The table's name (family `inet`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Drops every TCP packet to and from `port` on `lo`, in both directions, from now on.
    pub fn cut_port(&mut self, port: u16) -> Result<()> {
        nft_script(&format!(
            "add element inet {} ports {{ {port} }}\n",
            self.table
        ))?;
        if !self.ports.contains(&port) {
            self.ports.push(port);
        }
        Ok(())
    }

    /// Drops every packet to and from `addr` (a 127.0.0.x address other than the shared 127.0.0.1 is
    /// the way to isolate one node).
    pub fn cut_addr(&mut self, addr: Ipv4Addr) -> Result<()> {
        if !addr.is_loopback() {
            return Err(Error::State(format!(
                "refusing to cut {addr}: only loopback addresses are allowed"
            )));
        }
        nft_script(&format!(
            "add element inet {} addrs {{ {addr} }}\n",
            self.table
        ))?;
        if !self.addrs.contains(&addr) {
            self.addrs.push(addr);
        }
        Ok(())
    }

    /// Removes every cut (the table stays, empty).
    pub fn heal(&mut self) -> Result<()> {
        nft_script(&format!(
            "flush set inet {t} ports\nflush set inet {t} addrs\n",
            t = self.table
        ))?;
        self.ports.clear();
        self.addrs.clear();
        Ok(())
    }

    /// The ports currently cut.
    pub fn cut_ports(&self) -> &[u16] {
        &self.ports
    }

    /// The addresses currently cut.
    pub fn cut_addrs(&self) -> &[Ipv4Addr] {
        &self.addrs
    }
}

impl Drop for LoopbackCut {
    fn drop(&mut self) {
        if let Err(e) = nft_script(&format!("delete table inet {}\n", self.table)) {
            eprintln!(
                "distlock-testkit: could not delete nftables table inet {}: {e}",
                self.table
            );
        }
    }
}

/// Runs `nft -f -` with `script` on stdin.
fn nft_script(script: &str) -> Result<()> {
    let out = run_nft(&["-f", "-"], Some(script))?;
    if out.0 {
        Ok(())
    } else {
        Err(Error::io(
            format!("nft -f - <<'{}'", script.trim()),
            io::Error::other(out.1),
        ))
    }
}

/// Runs `nft args`; returns (success, stderr + stdout).
fn run_nft(args: &[&str], stdin: Option<&str>) -> Result<(bool, String)> {
    let mut child = Command::new(NFT)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                Error::MissingBinary {
                    program: NFT.to_owned(),
                    hint: NFT_INSTALL_HINT.to_owned(),
                }
            } else {
                Error::io("running nft", e)
            }
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| Error::io("writing to nft", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io("waiting for nft", e))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok((out.status.success(), text))
}

/// Deletes `distlock_<pid>_<n>` tables whose process is gone (a SIGKILLed test runs no `Drop`).
fn sweep_dead_tables() {
    let Ok((true, listing)) = run_nft(&["list", "tables"], None) else {
        return;
    };
    for table in dead_tables(&listing) {
        tracing::info!(%table, "deleting nftables table of a dead test process");
        let _ = nft_script(&format!("delete table inet {table}\n"));
    }
}

/// The tables in an `nft list tables` listing that belong to processes that no longer exist.
fn dead_tables(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .filter(|name| {
            name.strip_prefix(TABLE_PREFIX)
                .and_then(|rest| rest.split('_').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_tables_of_dead_processes_only() {
        let me = std::process::id();
        let listing = format!(
            "table inet filter\ntable inet distlock_{me}_0\ntable inet distlock_4294967294_3\n\
             table ip distlock_4294967294_1\n"
        );
        assert_eq!(dead_tables(&listing), vec!["distlock_4294967294_3"]);
    }
}
