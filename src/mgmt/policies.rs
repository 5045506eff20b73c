//! Policies under `/api/policies`, in RabbitMQ's shapes:
//! `GET /api/policies[/{vhost}[/{name}]]`, `PUT /api/policies/{vhost}/{name}` with
//! `{"pattern", "definition", "priority", "apply-to"}` (201 new, 204 replaced),
//! `DELETE /api/policies/{vhost}/{name}`. As in RabbitMQ, a user needs the
//! `policymaker` or `administrator` tag, and (unless an administrator) permissions in
//! the vhost. What Triad does not implement (a definition key, an `apply-to` value, a
//! body field) is a 400 naming it; see [`triad_core::policy`].

use serde_json::Value;
use triad_core::policy::{Policy, PolicyDoc};

use super::list::{respond, ListQuery};
use super::{no_content, ok_json, Api, ApiError, ApiResult};

fn may_manage(api: &Api) -> Result<(), ApiError> {
    if api.is_admin() || api.user.tags.iter().any(|t| t == "policymaker") {
        Ok(())
    } else {
        Err(ApiError::not_authorised("Not policymaker user"))
    }
}

fn may_use_vhost(api: &Api, vhost: &str) -> bool {
    api.is_admin() || api.broker().auth().access(&api.user.name, vhost).is_some()
}

/// A policy body (or a definitions file's entry), checked: unknown fields are refused.
pub fn doc_from_json(body: &Value) -> Result<PolicyDoc, ApiError> {
    let bad = ApiError::bad_request;
    let obj = body
        .as_object()
        .ok_or_else(|| bad("a policy must be a JSON object".into()))?;
    for k in obj.keys() {
        if !matches!(
            k.as_str(),
            "pattern" | "definition" | "priority" | "apply-to" | "vhost" | "name"
        ) {
            return Err(bad(format!("policy field '{k}' is not supported")));
        }
    }
    let pattern = obj
        .get("pattern")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("pattern is required (a string)".into()))?;
    let definition = obj
        .get("definition")
        .and_then(Value::as_object)
        .cloned()
        .ok_or_else(|| bad("definition is required (a JSON object)".into()))?;
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) => n
            .as_i64()
            .ok_or_else(|| bad(format!("priority {n} is not an integer")))?,
        Some(Value::String(s)) => s
            .parse()
            .map_err(|_| bad(format!("priority '{s}' is not an integer")))?,
        Some(other) => return Err(bad(format!("priority {other} is not an integer"))),
    };
    let apply_to = match obj.get("apply-to") {
        None | Some(Value::Null) => "all",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(bad(format!("apply-to {other} is not a string"))),
    };
    Ok(PolicyDoc {
        pattern: pattern.to_owned(),
        apply_to: apply_to.to_owned(),
        priority,
        definition,
    })
}

/// Validates a policy for `vhost`.
pub fn policy(vhost: &str, name: &str, body: &Value) -> Result<Policy, ApiError> {
    Policy::new(vhost, name, &doc_from_json(body)?)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

/// The GETs.
pub fn get(api: &Api, vhost: Option<&str>, name: Option<&str>) -> ApiResult {
    may_manage(api)?;
    let vhosts = match vhost {
        Some(v) => {
            api.broker().vhost(v).map_err(|_| ApiError::not_found())?;
            if !may_use_vhost(api, v) {
                return Err(ApiError::not_authorised(
                    "User not authorised to access virtual host",
                ));
            }
            vec![v.to_owned()]
        }
        None => api
            .broker()
            .vhost_names()
            .into_iter()
            .filter(|v| may_use_vhost(api, v))
            .collect(),
    };
    let mut items = Vec::new();
    for v in &vhosts {
        if let Ok(vh) = api.broker().vhost(v) {
            let mut ps = vh.policies();
            ps.sort_by(|a, b| a.name.cmp(&b.name));
            items.extend(ps);
        }
    }
    match name {
        // a listing: paged, filtered and sorted as queues are
        None => respond(
            ListQuery::parse(&api.params)?,
            items,
            |p| p.name.as_str(),
            |p| Some(p.to_json()),
        ),
        Some(n) => items
            .into_iter()
            .find(|p| p.name == n)
            .map_or_else(|| Err(ApiError::not_found()), |p| ok_json(&p.to_json())),
    }
}

/// Whether the user may set policies in `vhost` (checked before a body is parsed).
pub fn authorize(api: &Api, vhost: &str) -> Result<(), ApiError> {
    may_manage(api)?;
    api.broker()
        .vhost(vhost)
        .map_err(|_| ApiError::not_found())?;
    if !may_use_vhost(api, vhost) {
        return Err(ApiError::not_authorised(
            "User not authorised to access virtual host",
        ));
    }
    Ok(())
}

/// `PUT /api/policies/{vhost}/{name}`. A `name` or `vhost` in the body must be the
/// URL's (RabbitMQ 3.10 answers 201 and uses the URL's, silently; Triad refuses the
/// mismatch with a 400 naming it rather than ignore what it was sent).
pub fn put(api: &Api, vhost: &str, name: &str, body: &Value) -> ApiResult {
    authorize(api, vhost)?;
    let vh = api
        .broker()
        .vhost(vhost)
        .map_err(|_| ApiError::not_found())?;
    for (k, url) in [("name", name), ("vhost", vhost)] {
        match body.get(k) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == url => {}
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "the body's {k} {other} is not the URL's '{url}'"
                )))
            }
        }
    }
    let p = policy(vhost, name, body)?;
    let created = vh.set_policy(p)?;
    tracing::info!(vhost, policy = name, by = %api.user.name, "policy set through the management API");
    no_content(created)
}

/// `DELETE /api/policies/{vhost}/{name}`.
pub fn delete(api: &Api, vhost: &str, name: &str) -> ApiResult {
    may_manage(api)?;
    let vh = api
        .broker()
        .vhost(vhost)
        .map_err(|_| ApiError::not_found())?;
    if !may_use_vhost(api, vhost) {
        return Err(ApiError::not_authorised(
            "User not authorised to access virtual host",
        ));
    }
    if vh.delete_policy(name)? {
        tracing::info!(vhost, policy = name, by = %api.user.name, "policy deleted through the management API");
        no_content(false)
    } else {
        Err(ApiError::not_found())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_are_checked_field_by_field() {
        let d = doc_from_json(&json!({"pattern": "^a", "definition": {"max-length": 1}, "priority": "3", "apply-to": "queues"})).expect("doc");
        assert_eq!((d.priority, d.apply_to.as_str()), (3, "queues"));
        let d =
            doc_from_json(&json!({"pattern": "^a", "definition": {"max-length": 1}})).expect("doc");
        assert_eq!((d.priority, d.apply_to.as_str()), (0, "all"));
        let e = doc_from_json(&json!({"pattern": "a", "definition": {}, "component": "x"}))
            .expect_err("unknown field");
        assert!(e.reason.contains("'component'"), "{}", e.reason);
        assert!(doc_from_json(&json!({"definition": {}})).is_err());
        assert!(doc_from_json(&json!({"pattern": "a", "definition": 1})).is_err());
        let e = policy(
            "/",
            "p",
            &json!({"pattern": "a", "definition": {"alternate-exchange": "x"}}),
        )
        .expect_err("unsupported key");
        assert!(e.reason.contains("'alternate-exchange'"), "{}", e.reason);
    }
}
