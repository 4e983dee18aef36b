//! The records of resend operations (a resend `requestId`): what a repeat finds, and the one
//! string both engines store them as.

/// What `reserve_operation` found for a resend `requestId`, so a repeated resend returns the
/// recorded answer and resends nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum OperationReservation {
    /// Reserved now, for the caller.
    Fresh,
    /// Finished (completely or part-way): its recorded answer.
    Done(String),
    /// Reserved by a request with the same fingerprint that has not finished.
    InProgress,
    /// Reserved or finished by a request with a different fingerprint.
    Mismatch,
}

/// An operation as both backends store it, one string: `P<fingerprint>` while it runs,
/// `D<fingerprint>\n<answer>` once finished. Fingerprints are [`crate::digest::short_hash`]es,
/// so they hold no newline.
pub fn encode_running_operation(fingerprint: &str) -> String {
    format!("P{fingerprint}")
}

/// See [`encode_running_operation`].
pub fn encode_finished_operation(fingerprint: &str, answer: &str) -> String {
    format!("D{fingerprint}\n{answer}")
}

/// Reads a stored operation for a request with `fingerprint`. Records written before
/// fingerprints were stored (`P`, `D<answer>`, or an answer alone) match any fingerprint.
pub fn decode_operation(stored: &str, fingerprint: &str) -> OperationReservation {
    let matches = |recorded: &str| recorded.is_empty() || recorded == fingerprint;
    if let Some(recorded) = stored.strip_prefix('P') {
        return if matches(recorded) {
            OperationReservation::InProgress
        } else {
            OperationReservation::Mismatch
        };
    }
    let done = stored.strip_prefix('D').unwrap_or(stored);
    match done.split_once('\n') {
        Some((recorded, answer)) if matches(recorded) => {
            OperationReservation::Done(answer.to_string())
        }
        Some(_) => OperationReservation::Mismatch,
        None => OperationReservation::Done(done.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_round_trip_with_their_fingerprint() {
        let running = encode_running_operation("fp1");
        assert_eq!(
            decode_operation(&running, "fp1"),
            OperationReservation::InProgress
        );
        assert_eq!(
            decode_operation(&running, "fp2"),
            OperationReservation::Mismatch
        );
        let done = encode_finished_operation("fp1", r#"{"resent":1}"#);
        assert_eq!(
            decode_operation(&done, "fp1"),
            OperationReservation::Done(r#"{"resent":1}"#.into())
        );
        assert_eq!(
            decode_operation(&done, "fp2"),
            OperationReservation::Mismatch
        );
    }

    #[test]
    fn records_without_a_fingerprint_match_any_request() {
        assert_eq!(
            decode_operation("P", "fp"),
            OperationReservation::InProgress
        );
        for stored in [r#"D{"resent":1}"#, r#"{"resent":1}"#] {
            assert_eq!(
                decode_operation(stored, "fp"),
                OperationReservation::Done(r#"{"resent":1}"#.into()),
                "{stored}"
            );
        }
    }
}
