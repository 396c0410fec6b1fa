//! The `tracing` spans and events of acquires and holds: a `distlock.acquire` span per acquire with its
//! outcome, wait and token; a `distlock.hold` span from grant to release or loss, with the events of
//! Jeopardy, recovery and loss inside it, at the levels a service keeps on in production.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{LockState, Locks, MemoryBackend};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Instrument, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[derive(Debug, Clone, Default)]
struct SpanSeen {
    name: String,
    fields: HashMap<String, String>,
    closed: bool,
    follows_from: Vec<u64>,
}

#[derive(Debug, Clone)]
struct EventSeen {
    level: Level,
    message: String,
    /// The name of the span it was in (explicit parent or the current span).
    span: Option<String>,
    span_id: Option<u64>,
}

#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<HashMap<u64, SpanSeen>>>,
    events: Arc<Mutex<Vec<EventSeen>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").replace('"', ""),
        );
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut seen = SpanSeen {
            name: attrs.metadata().name().to_string(),
            ..SpanSeen::default()
        };
        attrs.record(&mut Fields(&mut seen.fields));
        self.spans.lock().unwrap().insert(id.into_u64(), seen);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        if let Some(seen) = self.spans.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut seen.fields));
        }
    }

    fn on_follows_from(&self, id: &Id, follows: &Id, _ctx: Context<'_, S>) {
        if let Some(seen) = self.spans.lock().unwrap().get_mut(&id.into_u64()) {
            seen.follows_from.push(follows.into_u64());
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let span = ctx.event_span(event);
        self.events.lock().unwrap().push(EventSeen {
            level: *event.metadata().level(),
            message: fields.remove("message").unwrap_or_default(),
            span: span.as_ref().map(|s| s.name().to_string()),
            span_id: span.map(|s| s.id().into_u64()),
        });
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        if let Some(seen) = self.spans.lock().unwrap().get_mut(&id.into_u64()) {
            seen.closed = true;
        }
    }
}

impl Capture {
    fn spans_named(&self, name: &str) -> Vec<(u64, SpanSeen)> {
        let mut spans: Vec<_> = self
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.name == name)
            .map(|(id, s)| (*id, s.clone()))
            .collect();
        spans.sort_by_key(|(id, _)| *id);
        spans
    }

    fn event(&self, message: &str) -> Option<EventSeen> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .find(|e| e.message == message)
            .cloned()
    }
}

/// Runs `test` on a current-thread runtime with `capture` as the thread's subscriber (the watchdog and
/// the background releases run on that thread too).
fn with_capture<F: std::future::Future<Output = ()>>(test: impl FnOnce(Capture) -> F) -> Capture {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test(capture.clone()));
    capture
}

#[test]
fn an_acquire_and_its_hold_have_spans_with_outcome_token_and_end() {
    let capture = with_capture(|_| async {
        let locks = Locks::new(MemoryBackend::new());
        let job = tracing::info_span!("the caller's job");
        async {
            let lock = locks.lock("traced").unwrap();
            let guard = lock.acquire().await.unwrap();
            // Reentrant: another acquire span, the same hold.
            let again = lock.acquire().await.unwrap();
            // A second owner's try finds it held.
            let other = locks.lock("traced").unwrap();
            assert!(other.try_acquire().await.unwrap().is_none());
            again.release().await.unwrap();
            guard.release().await.unwrap();
        }
        .instrument(job)
        .await;
    });
    let acquires = capture.spans_named("distlock.acquire");
    assert_eq!(acquires.len(), 3, "{acquires:?}");
    let (acquire_id, granted) = &acquires[0];
    assert_eq!(granted.fields["engine"], "memory");
    assert_eq!(granted.fields["lock"], "traced");
    assert_eq!(granted.fields["kind"], "mutex");
    assert_eq!(granted.fields["outcome"], "acquired");
    assert!(granted.fields.contains_key("wait_ms"), "{granted:?}");
    let token = &granted.fields["token"];
    assert!(granted.closed);
    assert_eq!(acquires[1].1.fields["outcome"], "acquired");
    assert_eq!(&acquires[1].1.fields["token"], token);
    assert_eq!(acquires[2].1.fields["outcome"], "busy");
    assert!(!acquires[2].1.fields.contains_key("token"));

    let holds = capture.spans_named("distlock.hold");
    assert_eq!(
        holds.len(),
        1,
        "only the grant opens a hold (not the reentrant acquire, not the busy try): {holds:?}"
    );
    let hold = &holds[0].1;
    assert_eq!(&hold.fields["token"], token);
    assert_eq!(hold.fields["end"], "released");
    assert!(hold.closed, "the release closes the hold's span");
    assert!(hold.follows_from.contains(acquire_id), "{hold:?}");
    let job = capture.spans_named("the caller's job");
    assert!(hold.follows_from.contains(&job[0].0), "{hold:?}");
    assert!(
        job[0].1.closed,
        "the hold (no parent) does not keep the caller's span open"
    );

    let acquired = capture.event("lock acquired").expect("a grant event");
    assert_eq!(acquired.level, Level::INFO);
    assert_eq!(acquired.span.as_deref(), Some("distlock.acquire"));
    let released = capture.event("lock released").expect("a release event");
    assert_eq!(released.level, Level::INFO);
    assert_eq!(released.span_id, Some(holds[0].0));
    let busy = capture
        .event("lock not acquired: held elsewhere")
        .expect("the busy try's event");
    assert_eq!(busy.level, Level::DEBUG);
}

#[test]
fn jeopardy_recovery_and_loss_are_events_of_the_hold_span() {
    let capture = with_capture(|_| async {
        let backend = MemoryBackend::new();
        let locks = Locks::new(backend.clone());
        // Jeopardy, then recovered: one renewal fails, the next succeeds.
        let guard = locks
            .lock("jeopardy")
            .unwrap()
            .options()
            .lease(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        backend.freeze();
        tokio::time::timeout(Duration::from_secs(5), guard.jeopardy())
            .await
            .expect("a failed renewal puts the hold in jeopardy");
        backend.unfreeze();
        let mut changes = guard.state_changes();
        tokio::time::timeout(
            Duration::from_secs(5),
            changes.wait_for(|s| *s == LockState::Held),
        )
        .await
        .expect("the next renewal recovers it")
        .unwrap();
        guard.release().await.unwrap();

        // Lost: every renewal fails until the deadline passes.
        let lost = locks
            .lock("lost")
            .unwrap()
            .options()
            .lease(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap();
        backend.freeze();
        tokio::time::timeout(Duration::from_secs(5), lost.lost())
            .await
            .expect("lost after the deadline");
        backend.unfreeze();
        // The store's own expiry comes a moment after the guard's deadline (which is 1 % early).
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            lost.release().await.is_err(),
            "a lost hold's release says so"
        );
    });
    let holds = capture.spans_named("distlock.hold");
    assert_eq!(holds.len(), 2, "{holds:?}");
    let (recovered_id, recovered) = &holds[0];
    assert_eq!(recovered.fields["end"], "released");
    let (lost_id, lost) = &holds[1];
    assert_eq!(lost.fields["end"], "lost");
    assert_eq!(
        lost.fields["reason"],
        "the validity deadline passed without a confirmed renewal"
    );
    assert!(lost.closed, "the loss closes the hold's span");

    let events = capture.events.lock().unwrap().clone();
    let in_span = |message: &str, span: u64| {
        events
            .iter()
            .find(|e| e.message == message && e.span_id == Some(span))
            .cloned()
            .unwrap_or_else(|| panic!("no {message:?} in span {span}: {events:?}"))
    };
    assert_eq!(
        in_span("renewal failed; lock in jeopardy", *recovered_id).level,
        Level::WARN
    );
    assert_eq!(
        in_span("renewal confirmed; lock held again", *recovered_id).level,
        Level::INFO
    );
    assert_eq!(in_span("lock lost", *lost_id).level, Level::WARN);
    // A lost hold's release is not a second end: one "lock released", the first hold's.
    let released: Vec<_> = events
        .iter()
        .filter(|e| e.message == "lock released")
        .collect();
    assert_eq!(released.len(), 1, "{released:?}");
    assert_eq!(released[0].span_id, Some(*recovered_id));
}
