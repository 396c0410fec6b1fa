//! A process that starts servers the way a test thread does and holds them until it is killed: the
//! self-test `servers_die_with_a_sigkilled_test_process` SIGKILLs it and checks that its servers die
//! with it (PR_SET_PDEATHSIG from the testkit's long-lived spawner thread).
//!
//! Usage: `testkit-server-holder PIDFILE` — writes "REDIS_PID NOBODY_SLEEP_PID" to PIDFILE.

use std::sync::Arc;
use std::time::Duration;

use distlock_testkit::process::{self, Probe, ServerProcess, ServerSpec};
use distlock_testkit::redis::RedisServer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pidfile = std::env::args_os()
        .nth(1)
        .ok_or("usage: testkit-server-holder PIDFILE")?;
    // Spawned from short-lived threads, as a test's thread would.
    let server = std::thread::spawn(RedisServer::start)
        .join()
        .map_err(|_| "spawner thread panicked")??;
    // The uid switch PostgreSQL needs clears PDEATHSIG in the kernel; the testkit sets it after the switch
    // (in pre_exec). Prove it with a process running as `nobody`.
    let nobody = std::thread::spawn(|| {
        let spec = ServerSpec::new("sleep", "sleep")
            .arg("600")
            .uid(65534)
            .gid(65534);
        let probe: process::ReadyProbe = Arc::new(|_| Probe::Ready);
        ServerProcess::spawn(spec, process::temp_dir("nobody")?, Vec::new(), probe)
    })
    .join()
    .map_err(|_| "spawner thread panicked")??;
    std::fs::write(&pidfile, format!("{} {}", server.pid(), nobody.pid()))?;
    std::thread::sleep(Duration::from_secs(600));
    Ok(())
}
