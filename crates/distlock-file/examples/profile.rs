//! A profiling harness for the file backend's cycle (issue 9): runs acquire + release cycles on a
//! tokio multi-thread runtime with 2 workers (as `distlock bench` does) and prints, beside the wall
//! clock, the figures that do not swing with the machine's load: the process's CPU time per cycle
//! (user + system, all threads, from `/proc/self/stat`) and, when `DISK` names a block device, the
//! device's write requests and sectors per cycle (`/sys/block/DISK/stat`; the whole device, so run it
//! while the disk is otherwise quiet). Under `strace -f -c` or `valgrind --tool=callgrind`, the fixed
//! cycle count makes the totals comparable between builds.
//!
//! ```text
//! cargo run --release -p distlock-file --example profile -- MODE DIR [CYCLES] [TASKS] [DISK]
//! ```
//!
//! `MODE`: `uncontended` (one task, one name; `uncontended-no-notify` and `uncontended-no-sync` the
//! same with inotify or `fdatasync` off), `shared` (`TASKS` tasks, default 16, each on its own
//! name, one `Locks`), `per-task` (the same with one `Locks` per task), `floor` (one task: a bare
//! `flock` + `pwrite` + `fdatasync` + unlock loop on one file, inline, as the bench's floor).
#![allow(clippy::print_stdout)] // a measuring tool: its output is the point

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use distlock_core::Locks;
use distlock_file::{FileBackend, FileConfig};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args
        .first()
        .map_or("uncontended", String::as_str)
        .to_string();
    let dir = PathBuf::from(
        args.get(1)
            .ok_or("usage: MODE DIR [CYCLES] [TASKS] [DISK]")?,
    );
    let cycles: usize = args.get(2).map_or(Ok(2000), |n| n.parse())?;
    let tasks: usize = args.get(3).map_or(Ok(16), |n| n.parse())?;
    let disk = args.get(4).cloned();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The cycles run in a spawned task, on the workers, as the bench's do (not in `block_on`'s thread).
    let measured = runtime.spawn(async move {
        // Warm-up: files exist, the inotify instance and the blocking pool are up.
        run(&mode, &dir, (cycles / 10).max(tasks), tasks).await?;
        let (cpu0, disk0, start) = (cpu_ticks()?, disk_stat(disk.as_deref()), Instant::now());
        let done = run(&mode, &dir, cycles, tasks).await?;
        let wall = start.elapsed();
        let (cpu1, disk1) = (cpu_ticks()?, disk_stat(disk.as_deref()));
        let n = done as f64;
        // USER_HZ: /proc reports CPU time in hundredths of a second on every Linux.
        let ticks = 100.0;
        print!(
            "{mode}: {done} cycles in {:.2} s: {:.0} cycles/s, wall {:.1} µs/cycle, CPU user {:.1} + system {:.1} µs/cycle",
            wall.as_secs_f64(),
            n / wall.as_secs_f64(),
            wall.as_secs_f64() * 1e6 / n,
            (cpu1.0 - cpu0.0) as f64 / ticks * 1e6 / n,
            (cpu1.1 - cpu0.1) as f64 / ticks * 1e6 / n,
        );
        if let (Some((w0, s0)), Some((w1, s1))) = (disk0, disk1) {
            print!(
                ", disk writes {:.2}/cycle, sectors {:.1}/cycle",
                (w1 - w0) as f64 / n,
                (s1 - s0) as f64 / n
            );
        }
        println!();
        Ok::<_, BoxError>(())
    });
    runtime.block_on(measured)?
}

/// Runs `cycles` cycles in all (split over the tasks); returns how many ran.
async fn run(mode: &str, dir: &Path, cycles: usize, tasks: usize) -> Result<usize, BoxError> {
    match mode {
        "uncontended" | "uncontended-no-notify" | "uncontended-no-sync" => {
            let config = FileConfig::new(dir)
                .with_notify(mode != "uncontended-no-notify")
                .with_sync(mode != "uncontended-no-sync");
            let locks = Locks::new(FileBackend::from_config(config)?);
            let lock = locks.lock("profile-uncontended")?;
            for _ in 0..cycles {
                lock.acquire().await?.release().await?;
            }
            Ok(cycles)
        }
        "shared" | "per-task" => {
            let shared = Arc::new(Locks::new(FileBackend::new(dir)?));
            let per = cycles / tasks;
            let mut handles = Vec::new();
            for task in 0..tasks {
                let locks = if mode == "shared" {
                    shared.clone()
                } else {
                    Arc::new(Locks::new(FileBackend::new(dir)?))
                };
                handles.push(tokio::spawn(async move {
                    let lock = locks.lock(&format!("profile-many-{task}"))?;
                    for _ in 0..per {
                        lock.acquire().await?.release().await?;
                    }
                    Ok::<_, BoxError>(())
                }));
            }
            for handle in handles {
                handle.await??;
            }
            Ok(per * tasks)
        }
        "floor" => {
            use rustix::fs::{flock, FlockOperation};
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.join(".profile-floor"))?;
            for _ in 0..cycles {
                flock(&file, FlockOperation::NonBlockingLockExclusive)?;
                rustix::io::pwrite(&file, &[0u8; 8], 0)?;
                rustix::fs::fdatasync(&file)?;
                flock(&file, FlockOperation::Unlock)?;
                tokio::task::yield_now().await;
            }
            Ok(cycles)
        }
        // The floor with its `fdatasync` moved off the task as a backend could move it: to tokio's
        // blocking pool (`floor-pool`), or into `block_in_place` (`floor-in-place`).
        "floor-pool" | "floor-in-place" | "floor-thread" => {
            use rustix::fs::{flock, FlockOperation};
            let file = Arc::new(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(dir.join(".profile-floor"))?,
            );
            type Job = (
                Arc<std::fs::File>,
                tokio::sync::oneshot::Sender<rustix::io::Result<()>>,
            );
            let (jobs, queue) = std::sync::mpsc::channel::<Job>();
            std::thread::spawn(move || {
                for (file, done) in queue {
                    let _ = done.send(rustix::fs::fdatasync(&*file));
                }
            });
            for _ in 0..cycles {
                flock(&*file, FlockOperation::NonBlockingLockExclusive)?;
                rustix::io::pwrite(&*file, &[0u8; 8], 0)?;
                if mode == "floor-thread" {
                    let (done, result) = tokio::sync::oneshot::channel();
                    jobs.send((file.clone(), done))?;
                    result.await??;
                } else if mode == "floor-pool" {
                    let file = file.clone();
                    tokio::task::spawn_blocking(move || rustix::fs::fdatasync(&*file)).await??;
                } else {
                    tokio::task::block_in_place(|| rustix::fs::fdatasync(&*file))?;
                }
                flock(&*file, FlockOperation::Unlock)?;
                tokio::task::yield_now().await;
            }
            Ok(cycles)
        }
        other => Err(format!("unknown mode {other}").into()),
    }
}

/// User and system CPU of the whole process so far, in clock ticks.
fn cpu_ticks() -> Result<(u64, u64), BoxError> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command (which may hold spaces) in parentheses; utime and stime are the 14th
    // and 15th fields of the line.
    let rest = stat.rsplit_once(')').ok_or("bad /proc/self/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Ok((fields[11].parse()?, fields[12].parse()?))
}

/// Write requests and sectors written so far on block device `disk` (e.g. `vda`).
fn disk_stat(disk: Option<&str>) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/sys/block/{}/stat", disk?)).ok()?;
    let fields: Vec<u64> = stat
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    Some((*fields.get(4)?, *fields.get(6)?))
}
