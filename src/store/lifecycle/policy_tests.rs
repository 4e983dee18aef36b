//! The delivery policy's unit tests: each classification, Retry-After, the backoff and the
//! window, and how a held message waits or dies.

use std::collections::BTreeMap;

use super::*;
use crate::store::{MessageId, MessageKind, NewMessage, Partitions};

fn claimed(backoff_step: u32, deadline: Millis) -> Lease {
    Lease {
        message: NewMessage {
            id: MessageId::generate(0, "k", Partitions::DEFAULT),
            kind: MessageKind::Notification,
            source: None,
            payment_id: Some("p".into()),
            transaction_id: None,
            ordering_key: "k".into(),
            event: Some("PIX_RECEIVED".into()),
            target_url: Some("http://example.com/cb".into()),
            headers: BTreeMap::new(),
            body: "{}".into(),
            created_at: 0,
            deadline,
        },
        token: 1,
        attempts: 2,
        backoff_step,
        deadline,
        resume_at: None,
        again: false,
    }
}

const BACKOFF: Backoff = Backoff {
    initial_ms: 1000,
    max_ms: 3_600_000,
};

fn status(s: u16) -> AttemptResult {
    AttemptResult {
        status: Some(s),
        error: None,
        retry_after: None,
        response: None,
    }
}

#[test]
fn classification() {
    let c = claimed(0, 100_000);
    assert_eq!(
        classify(&status(204), BACKOFF, &c, 0, 0.0),
        Verdict::Delivered
    );
    assert_eq!(
        classify(&status(410), BACKOFF, &c, 0, 0.0),
        Verdict::Dead(DeathReason::Gone)
    );
    for s in [500, 503, 429, 404, 301, 400] {
        assert_eq!(
            classify(&status(s), BACKOFF, &c, 0, 0.0),
            Verdict::Retry(1000),
            "{s}"
        );
    }
    let timeout = AttemptResult {
        status: None,
        error: Some(AttemptError::Timeout),
        retry_after: None,
        response: None,
    };
    assert_eq!(
        classify(&timeout, BACKOFF, &claimed(3, 100_000), 0, 0.0),
        Verdict::Retry(8000)
    );
    let later = AttemptResult {
        status: Some(429),
        error: None,
        retry_after: Some(RetryAfter::DelayMs(30_000)),
        response: None,
    };
    assert_eq!(
        classify(&later, BACKOFF, &c, 5, 0.0),
        Verdict::Retry(30_005)
    );
    // A date is resolved against the `now` given (the dispatcher's clock), and one in the
    // past or `Retry-After: 0` keeps the scheduled delay instead of retrying at once.
    let date = AttemptResult {
        retry_after: Some(RetryAfter::At(50_000)),
        ..later.clone()
    };
    assert_eq!(
        classify(&date, BACKOFF, &c, 20_000, 0.0),
        Verdict::Retry(50_000)
    );
    for retry_after in [RetryAfter::At(1_000), RetryAfter::DelayMs(0)] {
        let soon = AttemptResult {
            retry_after: Some(retry_after),
            ..later.clone()
        };
        assert_eq!(
            classify(&soon, BACKOFF, &c, 20_000, 0.0),
            Verdict::Retry(21_000),
            "{retry_after:?}"
        );
    }
    assert_eq!(
        classify(&status(500), BACKOFF, &c, 100_000, 0.0),
        Verdict::Dead(DeathReason::Expired)
    );
}

#[test]
fn host_signals() {
    let with = |s: u16, retry_after: Option<RetryAfter>| AttemptResult {
        retry_after,
        ..status(s)
    };
    assert_eq!(host_signal(&status(204), 5), HostSignal::Answered);
    assert_eq!(host_signal(&status(404), 5), HostSignal::Answered);
    assert_eq!(host_signal(&status(500), 5), HostSignal::Failed);
    assert_eq!(host_signal(&status(503), 5), HostSignal::Failed);
    assert_eq!(
        host_signal(&with(503, Some(RetryAfter::DelayMs(3_000))), 5),
        HostSignal::Throttled(3_005)
    );
    assert_eq!(
        host_signal(&with(429, Some(RetryAfter::At(9_000))), 5),
        HostSignal::Throttled(9_000)
    );
    assert_eq!(
        host_signal(&status(429), 5),
        HostSignal::Throttled(1_005),
        "a 429 without Retry-After"
    );
    assert_eq!(
        host_signal(&with(429, Some(RetryAfter::DelayMs(u64::MAX))), 0),
        HostSignal::Throttled(MAX_RETRY_AFTER_MS as Millis),
        "capped at 24 h"
    );
    for (error, signal) in [
        (AttemptError::Timeout, HostSignal::Failed),
        (AttemptError::Connect, HostSignal::Failed),
        (AttemptError::Request, HostSignal::Failed),
        (AttemptError::BadUrl, HostSignal::Answered),
        (AttemptError::RefusedAddress, HostSignal::Answered),
    ] {
        let r = AttemptResult {
            status: None,
            error: Some(error),
            retry_after: None,
            response: None,
        };
        assert_eq!(host_signal(&r, 0), signal, "{error:?}");
    }
}

#[test]
fn a_held_message_waits_but_not_past_its_deadline() {
    assert_eq!(hold(10_000, 0, 3_000, None), Held::Until(3_000));
    assert_eq!(
        hold(10_000, 0, 30_000, Some(DeathReason::BreakerOpen)),
        Held::Until(10_000)
    );
    assert_eq!(
        hold(10_000, 10_000, 30_000, Some(DeathReason::BreakerOpen)),
        Held::Dead(DeathReason::BreakerOpen)
    );
    assert_eq!(
        hold(10_000, 12_000, 30_000, None),
        Held::Dead(DeathReason::Expired)
    );
}

fn class(result: &AttemptResult) -> Option<&'static str> {
    FailureClass::of(result).map(FailureClass::as_str)
}

#[test]
fn failure_classes() {
    assert_eq!(class(&status(503)), Some("5xx"));
    assert_eq!(class(&status(410)), Some("4xx"));
    assert_eq!(class(&status(302)), Some("3xx"));
    assert_eq!(class(&status(204)), None, "a 2xx is no failure");
    for (error, label) in [
        (AttemptError::Timeout, "timeout"),
        (AttemptError::Connect, "connect"),
        (AttemptError::RefusedAddress, "refused_address"),
        (AttemptError::BadUrl, "bad_url"),
        (AttemptError::Request, "request"),
    ] {
        let r = AttemptResult {
            status: None,
            error: Some(error),
            retry_after: None,
            response: None,
        };
        assert_eq!(class(&r), Some(label));
    }
}

/// Metrics, alerts and the API show these labels: they stay byte for byte.
#[test]
fn labels_are_listed_in_order() {
    let labels = |all: &[FailureClass]| all.iter().map(|c| c.as_str()).collect::<Vec<_>>();
    assert_eq!(
        labels(&FailureClass::ALL),
        [
            "1xx",
            "3xx",
            "4xx",
            "5xx",
            "timeout",
            "connect",
            "refused_address",
            "request",
            "bad_url"
        ]
    );
    assert_eq!(
        DeathReason::ALL.map(DeathReason::as_str),
        ["gone", "expired", "breaker_open", "throttled"]
    );
}

#[test]
fn retry_after_forms() {
    assert_eq!(parse_retry_after("120"), Some(RetryAfter::DelayMs(120_000)));
    assert_eq!(parse_retry_after(" 0 "), Some(RetryAfter::DelayMs(0)));
    // 1,000,000 s after the epoch.
    let date = "Mon, 12 Jan 1970 13:46:40 GMT";
    assert_eq!(parse_retry_after(date), Some(RetryAfter::At(1_000_000_000)));
    assert_eq!(RetryAfter::At(1_000_000_000).delay_ms(999_910_000), 90_000);
    assert_eq!(RetryAfter::At(1_000_000_000).delay_ms(1_000_090_000), 0);
    assert_eq!(parse_retry_after("soon"), None);
    assert_eq!(parse_retry_after("-5"), None);
}

const DEFAULT: Backoff = Backoff {
    initial_ms: 1_000,
    max_ms: 3_600_000,
};
const WEEK: Millis = 7 * 86_400_000;

/// Walks the schedule of a target that is always down, from acceptance at 0.
fn attempts_until_dead(backoff: Backoff, deadline: Millis, jitter: f64) -> Vec<Millis> {
    let mut now = 0;
    let mut times = vec![now];
    let mut step = 0;
    while let Next::RetryAt(at) = next_attempt(backoff, step, now, deadline, jitter, None) {
        assert!(at > now, "time moves forward");
        now = at;
        times.push(now);
        step += 1;
    }
    times
}

#[test]
fn doubles_then_caps() {
    let delays: Vec<u64> = (0..14).map(|n| base_delay_ms(DEFAULT, n)).collect();
    assert_eq!(&delays[..4], &[1_000, 2_000, 4_000, 8_000]);
    assert_eq!(delays[11], 2_048_000);
    assert_eq!(delays[12], 3_600_000);
    assert_eq!(base_delay_ms(DEFAULT, 500), 3_600_000);
}

#[test]
fn seven_days_without_jitter_ends_exactly_at_the_deadline() {
    let times = attempts_until_dead(DEFAULT, WEEK, 0.0);
    assert_eq!(*times.last().unwrap(), WEEK);
    assert!(times.iter().all(|t| *t <= WEEK));
    // 13 doubling attempts (incl. the first) reach 4095 s, then hourly, then the deadline.
    assert_eq!(
        times.len(),
        13 + (WEEK as usize - 4_095_000) / 3_600_000 + 1
    );
}

#[test]
fn jitter_stays_within_half_and_never_passes_the_deadline() {
    for jitter in [0.0, 0.25, 0.5, 0.999] {
        let times = attempts_until_dead(DEFAULT, WEEK, jitter);
        assert_eq!(*times.last().unwrap(), WEEK);
        for (step, pair) in times.windows(2).enumerate() {
            let gap = (pair[1] - pair[0]) as u64;
            let base = base_delay_ms(DEFAULT, step as u32);
            assert!(gap <= base, "gap {gap} > base {base}");
            assert!(
                gap >= base / 2 || pair[1] == WEEK,
                "gap {gap} < half of {base}"
            );
        }
    }
}

#[test]
fn retry_after_postpones_but_not_past_the_deadline() {
    assert_eq!(
        next_attempt(DEFAULT, 0, 1_000, WEEK, 0.0, Some(120_000)),
        Next::RetryAt(121_000)
    );
    // Longer than the scheduled delay is honoured; 24 h is the most it may ask.
    assert_eq!(
        next_attempt(DEFAULT, 12, 0, WEEK, 0.0, Some(5 * 3_600_000)),
        Next::RetryAt(5 * 3_600_000)
    );
    assert_eq!(
        next_attempt(DEFAULT, 0, 0, WEEK, 0.0, Some(3 * 86_400_000)),
        Next::RetryAt(MAX_RETRY_AFTER_MS as Millis)
    );
    assert_eq!(
        next_attempt(DEFAULT, 0, WEEK - 10, WEEK, 0.0, Some(120_000)),
        Next::RetryAt(WEEK)
    );
    assert_eq!(
        next_attempt(DEFAULT, 0, WEEK, WEEK, 0.0, None),
        Next::GiveUp
    );
}

#[test]
fn retry_after_never_shortens_the_schedule() {
    for jitter in [0.0, 0.5, 0.999] {
        for step in [0, 3, 12, 40] {
            let scheduled = next_attempt(DEFAULT, step, 1_000, WEEK, jitter, None);
            // `Retry-After: 0`, a date in the past (resolved to 0) and a short delay all
            // keep the scheduled time.
            for asked in [0, 1, 499] {
                assert_eq!(
                    next_attempt(DEFAULT, step, 1_000, WEEK, jitter, Some(asked)),
                    scheduled,
                    "step {step}, jitter {jitter}, Retry-After {asked} ms"
                );
            }
        }
    }
}

#[test]
fn retry_after_zero_walks_the_plain_schedule() {
    // A target that always answers `Retry-After: 0` is retried exactly as one that sends
    // no Retry-After: the same 180 attempts over seven days, not a hot loop.
    let mut now = 0;
    let mut step = 0;
    let mut times = vec![now];
    while let Next::RetryAt(at) = next_attempt(DEFAULT, step, now, WEEK, 0.0, Some(0)) {
        assert!(at > now, "time moves forward");
        now = at;
        times.push(now);
        step += 1;
    }
    assert_eq!(times, attempts_until_dead(DEFAULT, WEEK, 0.0));
}

#[test]
fn a_short_window_gives_up_sooner() {
    let times = attempts_until_dead(DEFAULT, 15 * 60_000, 0.0);
    assert_eq!(*times.last().unwrap(), 15 * 60_000);
    assert!(times.len() < 15);
}
