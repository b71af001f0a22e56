{{/*
TOML rendering by type, for the [lifecycle] table passed through from values.
  ckptfs.toml.value: a scalar, list or inline table.
  ckptfs.toml.table: "key = value" lines of a map, sorted by key (nested maps as inline tables).
Strings are JSON-quoted, which is a valid TOML basic string. Numbers that are whole
(YAML gives float64 for every number) are printed as integers.
*/}}
{{- define "ckptfs.toml.value" -}}
{{- $v := . -}}
{{- $k := kindOf $v -}}
{{- if eq $k "string" -}}
{{ toJson $v }}
{{- else if eq $k "bool" -}}
{{ ternary "true" "false" $v }}
{{- else if or (eq $k "int") (eq $k "int64") -}}
{{ $v }}
{{- else if eq $k "float64" -}}
{{- if eq (float64 (int64 $v)) $v }}{{ int64 $v }}{{ else }}{{ $v }}{{ end -}}
{{- else if eq $k "slice" -}}
[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "ckptfs.toml.value" $e }}{{ end }}]
{{- else if eq $k "map" -}}
{ {{- range $i, $key := keys $v | sortAlpha }}{{ if $i }},{{ end }} {{ include "ckptfs.toml.key" $key }} = {{ include "ckptfs.toml.value" (get $v $key) }}{{ end }} }
{{- else if eq $k "invalid" -}}
{{- fail "TOML has no null: remove the key instead of setting it to null" -}}
{{- else -}}
{{- fail (printf "cannot render a %s as TOML" $k) -}}
{{- end -}}
{{- end -}}

{{- define "ckptfs.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end -}}
{{- end -}}

{{- define "ckptfs.toml.table" -}}
{{- $lines := list }}
{{- range $key := keys . | sortAlpha }}
{{- $lines = append $lines (printf "%s = %s" (include "ckptfs.toml.key" $key) (include "ckptfs.toml.value" (get $ $key))) }}
{{- end }}
{{- join "\n" $lines }}
{{- end -}}
