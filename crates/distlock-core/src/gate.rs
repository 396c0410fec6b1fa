//! The local gate of one name in one [`Locks`](crate::Locks): same-name waiters of the process queue
//! here, first come first served, so only the front one contends with the engine. A FIFO of our own
//! rather than tokio's mutex because the gate is passed to the next waiter *with a grant attached* when
//! the backend can hand a lock on in one request ([`Backend::hand_off`](crate::raw::Backend::hand_off)):
//! the releaser needs to see who is next, and the waiter to receive the grant with the gate.
//!
//! Cancel safety: a waiter that gives up before the gate reaches it leaves the queue; one that gives up
//! after (its pass was sent, not yet taken) passes the gate on, and a grant that came with it is
//! released on the server in the background before the gate moves on.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::clock::Instant;
use crate::error::{Error, ErrorKind, Result};
use crate::kinds::LockKind;
use crate::locks::LocksInner;
use crate::raw::{ErasedLease, Grant};
use crate::sync::lock;

#[derive(Default)]
pub(crate) struct Gate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    held: bool,
    /// Releases of this name (any owner) that passed the gate on before their reply and have not had
    /// it (see [`LocksInner::releasing`](crate::locks::LocksInner)): while none, an acquire need not
    /// look for its owner's. In the padding after `held`, so the gate is no larger (issue 9).
    releases_in_flight: u32,
    next_id: u64,
    waiters: Queue,
}

/// The waiters, boxed and made by the first one: most gates never have one, and a `VecDeque` inline
/// is 32 bytes, which put every gate (one per held lock) a glibc size class higher (issue 9's memory
/// per held lock). Freed when the gate is free again.
#[derive(Default)]
#[allow(clippy::box_collection)] // The box is the point: 8 bytes in the gate instead of 32.
struct Queue(Option<Box<VecDeque<Waiter>>>);

impl Queue {
    fn push_back(&mut self, waiter: Waiter) {
        self.0.get_or_insert_with(Box::default).push_back(waiter);
    }

    fn pop_front(&mut self) -> Option<Waiter> {
        self.0.as_mut()?.pop_front()
    }

    fn front(&self) -> Option<&Waiter> {
        self.0.as_ref()?.front()
    }

    /// Takes waiter `id` out of the queue; whether it was there.
    fn remove(&mut self, id: u64) -> bool {
        let Some(waiters) = self.0.as_mut() else {
            return false;
        };
        match waiters.iter().position(|w| w.id == id) {
            Some(at) => {
                waiters.remove(at);
                true
            }
            None => false,
        }
    }
}

struct Waiter {
    id: u64,
    owner: Arc<str>,
    lease: Duration,
    kind: LockKind,
    pass: oneshot::Sender<Pass>,
}

/// The front waiter, as the holder sees it when its hold ends.
pub(crate) struct NextWaiter {
    pub(crate) id: u64,
    pub(crate) owner: Arc<str>,
    pub(crate) lease: Duration,
    /// A mutex or a write lock: they share the name's gate.
    pub(crate) kind: LockKind,
}

/// What a waiter receives when the gate reaches it.
pub(crate) enum Pass {
    /// The gate alone: acquire as usual.
    Plain(GateGuard),
    /// The gate and the lock, handed on by the releaser in one request.
    Granted(HandedGrant),
}

/// The local gate, held: dropping it passes the gate to the next waiter still waiting.
#[must_use]
pub(crate) struct GateGuard {
    gate: Option<Arc<Gate>>,
}

/// A grant the releaser got for the next waiter, with the gate. Dropped before the waiter takes it
/// (the waiter gave up), the grant is released on the server in the background, and the gate passed
/// on only after that.
pub(crate) struct HandedGrant {
    pub(crate) gate: Option<GateGuard>,
    pub(crate) grant: Option<Grant<ErasedLease>>,
    /// When the handoff request was sent: the grant's validity deadline counts from here.
    pub(crate) sent_at: Instant,
    pub(crate) locks: Arc<LocksInner>,
    pub(crate) name: Arc<str>,
    pub(crate) owner: Arc<str>,
}

impl Drop for HandedGrant {
    fn drop(&mut self) {
        let Some(grant) = self.grant.take() else {
            return;
        };
        let gate = self.gate.take();
        let backend = self.locks.backend.clone();
        let (name, owner) = (self.name.clone(), self.owner.clone());
        tracing::debug!(lock = %name, "a lock handed to a waiter that gave up; releasing it in the background");
        self.locks.spawn_background(async move {
            if let Err(error) = backend.release(&grant.lease, &name, &owner).await {
                tracing::warn!(lock = %name, %error, "releasing a lock handed to a waiter that gave up failed");
            }
            drop(gate);
        });
    }
}

impl Gate {
    /// Counts a release of this name passed on early (see [`GateState::releases_in_flight`]).
    pub(crate) fn release_in_flight_started(&self) {
        let mut state = lock(&self.state);
        state.releases_in_flight = state.releases_in_flight.saturating_add(1);
    }

    /// Its reply came (or it was given up).
    pub(crate) fn release_in_flight_ended(&self) {
        let mut state = lock(&self.state);
        state.releases_in_flight = state.releases_in_flight.saturating_sub(1);
    }

    /// Whether any release of this name passed on early is waiting for its reply.
    pub(crate) fn has_releases_in_flight(&self) -> bool {
        lock(&self.state).releases_in_flight > 0
    }

    /// Takes the gate if it is free (nobody holds it, so nobody queues either); otherwise queues
    /// `owner` (asking for `lease` of `kind`) and returns the wait. No allocation when the gate is free.
    pub(crate) fn take_or_queue(
        self: &Arc<Self>,
        owner: &Arc<str>,
        lease: Duration,
        kind: LockKind,
    ) -> std::result::Result<GateGuard, GateWait> {
        let mut state = lock(&self.state);
        if !state.held {
            state.held = true;
            return Ok(GateGuard {
                gate: Some(self.clone()),
            });
        }
        state.next_id += 1;
        let id = state.next_id;
        let (pass, passed) = oneshot::channel();
        state.waiters.push_back(Waiter {
            id,
            owner: owner.clone(),
            lease,
            kind,
            pass,
        });
        Err(GateWait {
            gate: self.clone(),
            id,
            passed,
            done: false,
        })
    }

    /// Passes the gate to the front waiter, or frees it. A waiter that cannot take it (gone without
    /// leaving the queue) is skipped.
    fn pass_on(self: &Arc<Self>) {
        let mut state = lock(&self.state);
        while let Some(waiter) = state.waiters.pop_front() {
            // Sent under the lock: a waiter that gives up checks the queue under it, then reads its
            // receiver, so a pass is either not sent yet (it leaves the queue) or there to read.
            match waiter.pass.send(Pass::Plain(GateGuard {
                gate: Some(self.clone()),
            })) {
                Ok(()) => return,
                Err(Pass::Plain(mut unused)) => {
                    // The same gate we are passing: disarmed, not dropped (that would pass it again).
                    unused.gate = None;
                }
                // Not sent here: only plain passes are.
                Err(Pass::Granted(_)) => {}
            }
        }
        state.held = false;
        state.waiters = Queue::default();
    }
}

impl GateGuard {
    /// The front waiter, if any.
    pub(crate) fn next_waiter(&self) -> Option<NextWaiter> {
        let gate = self.gate.as_ref()?;
        let state = lock(&gate.state);
        state.waiters.front().map(|w| NextWaiter {
            id: w.id,
            owner: w.owner.clone(),
            lease: w.lease,
            kind: w.kind,
        })
    }

    /// Passes the gate with `handed` (a grant for waiter `id`, the front one when the handoff began).
    /// If that waiter has given up since, the grant is released in the background and the gate passed
    /// on after that.
    pub(crate) fn pass_with_grant(mut self, id: u64, mut handed: HandedGrant) {
        let Some(gate) = self.gate.take() else {
            return;
        };
        let mut state = lock(&gate.state);
        // Only the holder pops the queue: the front is `id`, or `id` left it.
        if state.waiters.front().is_some_and(|w| w.id == id) {
            if let Some(waiter) = state.waiters.pop_front() {
                handed.gate = Some(GateGuard {
                    gate: Some(gate.clone()),
                });
                match waiter.pass.send(Pass::Granted(handed)) {
                    Ok(()) => return,
                    Err(unsent) => {
                        drop(state);
                        // Releases the grant, then passes the gate on.
                        drop(unsent);
                        return;
                    }
                }
            }
        }
        drop(state);
        handed.gate = Some(GateGuard { gate: Some(gate) });
        drop(handed);
    }
}

impl Drop for GateGuard {
    fn drop(&mut self) {
        if let Some(gate) = self.gate.take() {
            gate.pass_on();
        }
    }
}

/// A queued waiter's wait for the gate. Dropped before it finished, it leaves the queue, or passes on
/// a gate (and releases a grant) that reached it meanwhile.
pub(crate) struct GateWait {
    gate: Arc<Gate>,
    id: u64,
    passed: oneshot::Receiver<Pass>,
    done: bool,
}

impl Future for GateWait {
    type Output = Result<Pass>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        match Pin::new(&mut this.passed).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(passed) => {
                this.done = true;
                Poll::Ready(passed.map_err(|_| {
                    Error::new(
                        ErrorKind::Protocol,
                        "internal error: the local gate was dropped with a waiter queued",
                    )
                }))
            }
        }
    }
}

impl Drop for GateWait {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        {
            let mut state = lock(&self.gate.state);
            if state.waiters.remove(self.id) {
                return;
            }
        }
        // Out of the queue: the pass was sent (under the gate's lock, before we looked). Dropping it
        // passes the gate on, and releases a grant that came with it.
        self.passed.close();
        if let Ok(pass) = self.passed.try_recv() {
            drop(pass);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use std::sync::Arc;
    use std::time::Duration;

    use super::{Gate, GateGuard, GateWait, LockKind, Pass};

    fn owner(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    /// A gate held by "a", with "b" then "c" queued behind it.
    fn held_by_a_with_b_and_c_queued() -> (Arc<Gate>, GateGuard, GateWait, GateWait) {
        let gate = Arc::new(Gate::default());
        let held = gate
            .take_or_queue(&owner("a"), Duration::ZERO, LockKind::Mutex)
            .ok()
            .expect("free");
        let queued = |name| {
            gate.take_or_queue(&owner(name), Duration::ZERO, LockKind::Mutex)
                .err()
                .expect("queued")
        };
        let (b, c) = (queued("b"), queued("c"));
        (gate, held, b, c)
    }

    /// Waiters get the gate in the order they queued.
    #[tokio::test]
    async fn the_gate_passes_in_queue_order() {
        let (gate, held, first, second) = held_by_a_with_b_and_c_queued();
        assert_eq!(
            held.next_waiter().map(|w| w.owner.to_string()),
            Some("b".into())
        );
        drop(held);
        let Ok(Pass::Plain(first)) = first.await else {
            panic!("the first waiter gets the gate");
        };
        assert_eq!(
            first.next_waiter().map(|w| w.owner.to_string()),
            Some("c".into())
        );
        drop(first);
        let Ok(Pass::Plain(second)) = second.await else {
            panic!("the second waiter gets the gate");
        };
        drop(second);
        assert!(gate
            .take_or_queue(&owner("d"), Duration::ZERO, LockKind::Mutex)
            .is_ok());
    }

    /// A gate makes its queue for its first waiter and frees it when it is free again (issue 9: one
    /// gate per held lock, most with no waiter).
    #[tokio::test]
    async fn the_queue_is_made_by_the_first_waiter_and_freed_with_the_gate() {
        let queue_made = |gate: &Gate| crate::sync::lock(&gate.state).waiters.0.is_some();
        let gate = Arc::new(Gate::default());
        let held = gate
            .take_or_queue(&owner("a"), Duration::ZERO, LockKind::Mutex)
            .ok()
            .expect("free");
        assert!(!queue_made(&gate));
        let waiting = gate
            .take_or_queue(&owner("b"), Duration::ZERO, LockKind::Mutex)
            .err()
            .expect("queued");
        assert!(queue_made(&gate));
        drop(held);
        let Ok(Pass::Plain(second)) = waiting.await else {
            panic!("the waiter gets the gate");
        };
        drop(second);
        assert!(!queue_made(&gate));
    }

    /// A waiter that gives up before the gate reaches it leaves the queue: the gate skips it.
    #[tokio::test]
    async fn a_waiter_that_gives_up_in_the_queue_is_skipped() {
        let (_gate, held, gone, next) = held_by_a_with_b_and_c_queued();
        drop(gone);
        assert_eq!(
            held.next_waiter().map(|w| w.owner.to_string()),
            Some("c".into())
        );
        drop(held);
        let passed = tokio::time::timeout(Duration::from_secs(1), next)
            .await
            .expect("the gate reaches the waiter after the one that gave up");
        assert!(matches!(passed, Ok(Pass::Plain(_))));
    }

    /// A waiter dropped after the gate was passed to it (not yet taken) passes it on: the gate is not
    /// stuck with nobody.
    #[tokio::test]
    async fn a_waiter_dropped_after_the_pass_passes_the_gate_on() {
        let (gate, held, passed_but_gone, next) = held_by_a_with_b_and_c_queued();
        drop(held);
        drop(passed_but_gone);
        let passed = tokio::time::timeout(Duration::from_secs(1), next)
            .await
            .expect("the gate moves on");
        let Ok(Pass::Plain(guard)) = passed else {
            panic!("a plain pass");
        };
        drop(guard);
        assert!(gate
            .take_or_queue(&owner("d"), Duration::ZERO, LockKind::Mutex)
            .is_ok());
    }
}
