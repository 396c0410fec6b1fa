//! `--sweep`: the `many` workload (b) at 1, 2, 4, 8, 16 and 64 tasks in one run, for distlock (one
//! shared `Locks`, one `Locks` per task) and the engine's main baseline, so the report shows how the
//! cost grows with concurrency (issue 9, deliverable 5).

use serde::Serialize;

use crate::measure::{Baseline, Run};
use crate::report::CycleFigures;
use crate::{Error, Runner};

/// The task counts of a sweep.
pub const SWEEP_TASKS: [usize; 6] = [1, 2, 4, 8, 16, 64];

/// The sweep section of the report.
#[derive(Debug, Serialize)]
pub struct Sweep {
    /// What the baseline column is (the engine's main (b) baseline), `None` without one.
    pub baseline: Option<String>,
    /// One point per task count, in [`SWEEP_TASKS`] order.
    pub points: Vec<SweepPoint>,
}

/// The (b) figures at one task count.
#[derive(Debug, Serialize)]
pub struct SweepPoint {
    pub tasks: usize,
    pub distlock_shared: Option<CycleFigures>,
    pub distlock_per_task: Option<CycleFigures>,
    pub baseline: Option<CycleFigures>,
}

impl SweepPoint {
    /// The point's figures, distlock's first.
    pub fn figures(&self) -> impl Iterator<Item = &CycleFigures> {
        self.distlock_shared
            .iter()
            .chain(&self.distlock_per_task)
            .chain(&self.baseline)
    }
}

impl Run<'_> {
    /// Runs (b) at every count of [`SWEEP_TASKS`].
    pub(crate) async fn sweep(&self, runner: &mut Runner) -> Result<Sweep, Error> {
        let mut points = Vec::with_capacity(SWEEP_TASKS.len());
        let mut baseline_label = None;
        for tasks in SWEEP_TASKS {
            let mut config = self.config.clone();
            config.many_tasks = tasks;
            let at = Run {
                config: &config,
                ..*self
            };
            let (distlock_shared, distlock_per_task) = match self.locks {
                Some(locks) => (
                    Some(at.many_shared(locks, runner).await?),
                    Some(at.many_per_task(runner).await?),
                ),
                None => (None, None),
            };
            let baseline = at.sweep_baseline(runner).await?;
            if let Some(b) = &baseline {
                baseline_label = Some(b.label.clone());
            }
            points.push(SweepPoint {
                tasks,
                distlock_shared,
                distlock_per_task,
                baseline,
            });
        }
        Ok(Sweep {
            baseline: baseline_label,
            points,
        })
    }

    /// The engine's main (b) baseline: on Redis the same-scripts loop on one shared connection (the
    /// like-for-like peer of one shared `Locks`), elsewhere the engine's only (b) baseline.
    async fn sweep_baseline(&self, runner: &mut Runner) -> Result<Option<CycleFigures>, Error> {
        match self.baseline {
            Baseline::None => Ok(None),
            Baseline::Redis { .. } => Ok(Some(self.same_scripts_many(runner, true).await?)),
            _ => Ok(self.many_baselines(runner).await?.into_iter().next()),
        }
    }
}
