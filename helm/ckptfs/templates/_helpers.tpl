{{- define "ckptfs.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ckptfs.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ckptfs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ckptfs.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ckptfs.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ckptfs.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ckptfs.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ckptfs.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ckptfs.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "ckptfs.bucketUrl" -}}
{{- required "s3.bucketUrl is required (s3://bucket[/prefix] or file:///dir)" .Values.s3.bucketUrl }}
{{- end }}

{{/* Credentials: only references to an existing Secret, never values. */}}
{{- define "ckptfs.credentialsEnv" -}}
{{- if .Values.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}

{{/* s3.credentials: refuse a combination where another provider of the AWS chain would win. */}}
{{- define "ckptfs.checkCredentials" -}}
{{- $mode := .Values.s3.credentials | default "auto" }}
{{- $roleArn := index (.Values.serviceAccount.annotations | default dict) "eks.amazonaws.com/role-arn" }}
{{- if and (eq $mode "existingSecret") (not .Values.s3.existingSecret) }}
{{- fail "s3.credentials is existingSecret: set s3.existingSecret to the Secret's name" }}
{{- end }}
{{- if and (ne $mode "existingSecret") (ne $mode "auto") .Values.s3.existingSecret }}
{{- fail (printf "s3.credentials is %s but s3.existingSecret is set: its keys would win over %s; remove one" $mode $mode) }}
{{- end }}
{{- if and (eq $mode "irsa") (not $roleArn) }}
{{- fail "s3.credentials is irsa: set serviceAccount.annotations.\"eks.amazonaws.com/role-arn\" to the role's ARN" }}
{{- end }}
{{- if and (eq $mode "podIdentity") $roleArn }}
{{- fail "s3.credentials is podIdentity but serviceAccount.annotations has eks.amazonaws.com/role-arn: IRSA would win over Pod Identity; remove the annotation" }}
{{- end }}
{{- end }}

{{/* Refuse a grace period that would cut the preStop drain short. */}}
{{- define "ckptfs.checkShutdown" -}}
{{- $timeout := int .Values.shutdown.drainTimeoutSeconds }}
{{- $grace := int .Values.shutdown.terminationGracePeriodSeconds }}
{{- if le $grace (add $timeout 30) }}
{{- fail (printf "shutdown.terminationGracePeriodSeconds (%d) must be greater than shutdown.drainTimeoutSeconds (%d) + 30: kubelet kills the gateway when the grace period ends, cutting the preStop drain short" $grace $timeout) }}
{{- end }}
{{- end }}
