//! The kinds workload (issue 25): one task, one name, read-lock cycles and then permit cycles, each
//! beside its same-layout bare loop measured in the same run (Redis: distlock's own read and permit
//! scripts by `EVALSHA`; PostgreSQL advisory mode: the bare shared pair with the reader's token read,
//! and the permit's bare statements; file: `flock(LOCK_SH)` on a lock file, and a slot file's
//! `flock(LOCK_EX)`). Other engines get distlock's figures alone.

use std::time::Duration;

use distlock::{ErrorKind, LockGuard, RwLock, Semaphore};

use crate::engines::{Engine, FlockFloor};
use crate::error::Error;
use crate::harness::{run_cycles, Cycler};
use crate::measure::{Baseline, Run};
use crate::report::{CycleFigures, KindsSection, Uncontended};
use crate::same_scripts::{KindScripts, SamePermitScripts, SameReadScripts};
use crate::{Runner, WARMUP_ONE};

/// The permits of the workload's semaphore (one task takes one: never more than slot 0 busy).
pub(crate) const PERMIT_LIMIT: u32 = 4;

/// distlock's label of the read-lock cycle.
pub(crate) const DISTLOCK_READ: &str = "distlock read lock";
/// distlock's label of the permit cycle.
pub(crate) const DISTLOCK_PERMIT: &str = "distlock permit";
/// Redis: distlock's read scripts by `EVALSHA`, nothing else.
pub(crate) const SAME_READ_SCRIPTS: &str = "same read scripts as distlock (EVALSHA)";
/// Redis: distlock's permit scripts by `EVALSHA`, nothing else.
pub(crate) const SAME_PERMIT_SCRIPTS: &str = "same permit scripts as distlock (EVALSHA)";
/// PostgreSQL: the bare shared advisory pair plus the reader's token read (pipelined).
pub(crate) const BARE_SHARED_PAIR: &str =
    "bare pg_advisory_lock_shared + token read (pipelined), pg_advisory_unlock_shared";
/// PostgreSQL: the permit's bare statements.
pub(crate) const BARE_PERMIT: &str =
    "bare try key shared + slot key + counter bump (one statement), unlock both + NOTIFY";
/// file: a reader's floor.
pub(crate) const FLOCK_SHARED: &str = "bare flock LOCK_SH + unlock";

/// Read-lock cycles through distlock's `RwLock`.
struct DistlockRead {
    rw: RwLock,
}

impl Cycler for DistlockRead {
    type Held = LockGuard;

    async fn acquire(&self, wait: Duration) -> Result<Option<LockGuard>, Error> {
        match self.rw.reader().options().wait(wait).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(e) if e.kind() == ErrorKind::Timeout => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(&self, guard: LockGuard) -> Result<(), Error> {
        guard.release().await.map_err(Error::from)
    }
}

/// Permit cycles through distlock's `Semaphore`: each acquire takes a permit as a new owner, as
/// `Semaphore::acquire` does.
struct DistlockPermit {
    semaphore: Semaphore,
}

impl Cycler for DistlockPermit {
    type Held = LockGuard;

    async fn acquire(&self, wait: Duration) -> Result<Option<LockGuard>, Error> {
        match self.semaphore.permit().options().wait(wait).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(e) if e.kind() == ErrorKind::Timeout => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(&self, guard: LockGuard) -> Result<(), Error> {
        guard.release().await.map_err(Error::from)
    }
}

impl Run<'_> {
    /// The kinds workload: the read lock's bare loop then distlock's, the permit's bare loop then
    /// distlock's.
    pub(crate) async fn kinds(&self, runner: &mut Runner) -> Result<KindsSection, Error> {
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        let kinds = self.locks.map(|l| l.capabilities().kinds);

        let mut read = Uncontended {
            distlock: None,
            baselines: self.read_baselines(runner).await?,
        };
        if let (Some(locks), Some(true)) = (self.locks, kinds.map(|k| k.read_write)) {
            runner.step("(kinds) distlock, read lock");
            let rw = locks.read_write(&format!("distlock-bench/{run}/kinds-read"))?;
            let cycles = run_cycles(vec![DistlockRead { rw }], WARMUP_ONE, d).await?;
            read.distlock = Some(CycleFigures::new(DISTLOCK_READ, &cycles, rtt));
        }

        let mut permit = Uncontended {
            distlock: None,
            baselines: self.permit_baselines(runner).await?,
        };
        if let (Some(locks), Some(true)) = (self.locks, kinds.map(|k| k.semaphore)) {
            runner.step("(kinds) distlock, permit");
            let name = format!("distlock-bench/{run}/kinds-permit");
            let semaphore = locks.semaphore(&name, PERMIT_LIMIT)?;
            let cycles = run_cycles(vec![DistlockPermit { semaphore }], WARMUP_ONE, d).await?;
            permit.distlock = Some(CycleFigures::new(DISTLOCK_PERMIT, &cycles, rtt));
        }
        Ok(KindsSection {
            permit_limit: PERMIT_LIMIT,
            read,
            permit,
        })
    }

    async fn read_baselines(&self, runner: &mut Runner) -> Result<Vec<CycleFigures>, Error> {
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        let name = format!("distlock-bench-same/{run}/kinds-read");
        let cycles = match (self.baseline, &self.config.engine) {
            (Baseline::Redis { conn, .. }, _) => {
                runner.step("(kinds) same read scripts loop");
                let client =
                    SameReadScripts::new(conn.clone(), KindScripts::new(), &name, self.owner(0));
                (
                    SAME_READ_SCRIPTS,
                    run_cycles(vec![client], WARMUP_ONE, d).await?,
                )
            }
            (Baseline::Postgres { url }, Engine::Postgres { advisory: true, .. }) => {
                runner.step("(kinds) bare shared advisory pair + token read");
                let client = crate::postgres::BareShared::new(url, &name).await?;
                (
                    BARE_SHARED_PAIR,
                    run_cycles(vec![client], WARMUP_ONE, d).await?,
                )
            }
            (Baseline::File { dir, .. }, _) => {
                runner.step("(kinds) bare flock LOCK_SH");
                let path = dir.join(format!(".distlock-bench-floor-{run}-kinds-read"));
                let floor = FlockFloor::shared(path)?;
                (FLOCK_SHARED, run_cycles(vec![floor], WARMUP_ONE, d).await?)
            }
            _ => return Ok(Vec::new()),
        };
        Ok(vec![CycleFigures::new(cycles.0, &cycles.1, rtt)])
    }

    async fn permit_baselines(&self, runner: &mut Runner) -> Result<Vec<CycleFigures>, Error> {
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        let name = format!("distlock-bench-same/{run}/kinds-permit");
        let (label, cycles) = match (self.baseline, &self.config.engine) {
            (Baseline::Redis { conn, .. }, _) => {
                runner.step("(kinds) same permit scripts loop");
                let client = SamePermitScripts::new(
                    conn.clone(),
                    KindScripts::new(),
                    &name,
                    &self.owner(0),
                    PERMIT_LIMIT,
                );
                (
                    SAME_PERMIT_SCRIPTS.to_string(),
                    run_cycles(vec![client], WARMUP_ONE, d).await?,
                )
            }
            (Baseline::Postgres { url }, Engine::Postgres { advisory: true, .. }) => {
                runner.step("(kinds) bare permit statements");
                let client = crate::postgres::BarePermit::new(url, &name).await?;
                (
                    BARE_PERMIT.to_string(),
                    run_cycles(vec![client], WARMUP_ONE, d).await?,
                )
            }
            (Baseline::File { dir, sync }, _) => {
                // A permit is slot file 0's `LOCK_EX`, with a record written (and synced when the
                // backend syncs), as the mutex's lock file.
                let label = format!("slot file: {}", crate::measure::floor_label(*sync));
                runner.step(&format!("(kinds) {label}"));
                let path = dir.join(format!(".distlock-bench-floor-{run}-kinds.sem.0"));
                let floor = FlockFloor::new(path, *sync)?;
                (label, run_cycles(vec![floor], WARMUP_ONE, d).await?)
            }
            _ => return Ok(Vec::new()),
        };
        Ok(vec![CycleFigures::new(label, &cycles, rtt)])
    }
}
