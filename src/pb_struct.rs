//! `google.protobuf.Struct` and YAML values, both ways: a rule's `metadata:`
//! arrives as YAML from files and as a `Struct` over xDS, and goes back to
//! Envoy as a `Struct` in the response's dynamic metadata.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::collections::HashMap;

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

/// A YAML value as a protobuf value: numbers as doubles, a map's
/// non-string keys written out as YAML, tags dropped.
pub fn value_from_yaml(v: &serde_yaml::Value) -> Value {
    use serde_yaml::Value as Y;
    let kind = match v {
        Y::Null => Kind::NullValue(0),
        Y::Bool(b) => Kind::BoolValue(*b),
        Y::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Y::String(s) => Kind::StringValue(s.clone()),
        Y::Sequence(items) => Kind::ListValue(ListValue {
            values: items.iter().map(value_from_yaml).collect(),
        }),
        Y::Mapping(_) => Kind::StructValue(struct_from_yaml(v)),
        Y::Tagged(t) => return value_from_yaml(&t.value),
    };
    Value { kind: Some(kind) }
}

/// A YAML map as a `Struct` (anything else: an empty one).
pub fn struct_from_yaml(v: &serde_yaml::Value) -> Struct {
    let serde_yaml::Value::Mapping(map) = v else {
        return Struct::default();
    };
    let fields = map
        .iter()
        .map(|(k, v)| {
            let key = match k {
                serde_yaml::Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other)
                    .map(|s| s.trim_end().to_string())
                    .unwrap_or_default(),
            };
            (key, value_from_yaml(v))
        })
        .collect::<HashMap<_, _>>();
    Struct { fields }
}

/// A protobuf value as YAML (whole doubles become integers).
pub fn yaml_from_value(v: &Value) -> serde_yaml::Value {
    use serde_yaml::Value as Y;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Y::Null,
        Some(Kind::BoolValue(b)) => Y::Bool(*b),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => {
            Y::Number((*n as i64).into())
        }
        Some(Kind::NumberValue(n)) => Y::Number((*n).into()),
        Some(Kind::StringValue(s)) => Y::String(s.clone()),
        Some(Kind::ListValue(l)) => Y::Sequence(l.values.iter().map(yaml_from_value).collect()),
        Some(Kind::StructValue(s)) => yaml_from_struct(s),
    }
}

/// A `Struct` as a YAML map, its keys sorted (a `Struct` has no order).
pub fn yaml_from_struct(s: &Struct) -> serde_yaml::Value {
    let mut keys: Vec<&String> = s.fields.keys().collect();
    keys.sort();
    let mut map = serde_yaml::Mapping::new();
    for k in keys {
        map.insert(
            serde_yaml::Value::String(k.clone()),
            yaml_from_value(&s.fields[k]),
        );
    }
    serde_yaml::Value::Mapping(map)
}

/// Merges `src` into `dest`: a key both hold as maps is merged, key by
/// key; otherwise the value already in `dest` stays (as envoyproxy/ratelimit
/// merges the metadata of the descriptors that passed).
pub fn merge(dest: &mut Struct, src: &Struct) {
    for (k, v) in &src.fields {
        match (dest.fields.get_mut(k), &v.kind) {
            (
                Some(Value {
                    kind: Some(Kind::StructValue(d)),
                }),
                Some(Kind::StructValue(s)),
            ) => merge(d, s),
            (Some(_), _) => {}
            (None, _) => {
                dest.fields.insert(k.clone(), v.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_struct_round_trip() {
        let yaml: serde_yaml::Value = serde_yaml::from_str(
            "name: service_1\nweight: 3\nratio: 0.5\non: true\ntags: [a, b]\nnested: {x: 1}\n",
        )
        .expect("yaml");
        let s = struct_from_yaml(&yaml);
        assert_eq!(
            s.fields["name"].kind,
            Some(Kind::StringValue("service_1".into()))
        );
        assert_eq!(s.fields["weight"].kind, Some(Kind::NumberValue(3.0)));
        let back = yaml_from_struct(&s);
        let again: serde_yaml::Value = serde_yaml::from_str(
            "name: service_1\nnested: {x: 1}\non: true\nratio: 0.5\ntags: [a, b]\nweight: 3\n",
        )
        .expect("yaml");
        assert_eq!(back, again);
    }

    #[test]
    fn merge_keeps_the_first_and_merges_maps() {
        let a = struct_from_yaml(&serde_yaml::from_str("s: {name: one}\nk: 1\n").expect("a"));
        let b = struct_from_yaml(
            &serde_yaml::from_str("s: {name: two, extra: 2}\nk: 9\nnew: x\n").expect("b"),
        );
        let mut merged = a.clone();
        merge(&mut merged, &b);
        let want: serde_yaml::Value =
            serde_yaml::from_str("k: 1\nnew: x\ns: {extra: 2, name: one}\n").expect("want");
        assert_eq!(yaml_from_struct(&merged), want);
    }
}
