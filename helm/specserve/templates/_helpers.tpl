{{/* Names and labels. */}}
{{- define "specserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specserve.labels" -}}
{{ include "specserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The image: image.tag, or what Dockerfile.gpu / Dockerfile.cpu build
     (specserve:<appVersion>-gpu when any pool asks for GPUs, -cpu otherwise). */}}
{{- define "specserve.image" -}}
{{- $flavor := ternary "gpu" "cpu" (or (gt (include "specserve.targetGpus" . | int) 0) (gt (include "specserve.draftGpus" . | int) 0)) -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $flavor)) -}}
{{- end -}}

{{/* A replica-count bound of an AppConfig pool: (list replicasMapOrNil key), default 1. */}}
{{- define "specserve.bound" -}}
{{- $r := index . 0 | default dict -}}
{{- if and (hasKey $r (index . 1)) (not (kindIs "invalid" (get $r (index . 1)))) -}}
{{- get $r (index . 1) | int -}}
{{- else -}}1{{- end -}}
{{- end -}}

{{/* nvidia.com/gpu per target pod: tensor_parallel_size x gpus_per_worker. */}}
{{- define "specserve.targetGpus" -}}
{{- $t := .Values.specserve.target | default dict -}}
{{- if not (kindIs "invalid" .Values.workerGroups.target.gpus) -}}
{{- .Values.workerGroups.target.gpus | int -}}
{{- else -}}
{{- $res := $t.resources | default dict -}}
{{- mulf ($t.tensor_parallel_size | default 1) ($res.gpus_per_worker | default 0) | ceil | int -}}
{{- end -}}
{{- end -}}

{{/* nvidia.com/gpu per draft pod: the largest gpus_per_worker of the drafts, rounded up. */}}
{{- define "specserve.draftGpus" -}}
{{- if not (kindIs "invalid" .Values.workerGroups.draft.gpus) -}}
{{- .Values.workerGroups.draft.gpus | int -}}
{{- else -}}
{{- $g := 0.0 -}}
{{- range .Values.specserve.drafts -}}
{{- $x := (.resources | default dict).gpus_per_worker | default 0 | float64 -}}
{{- if gt $x $g }}{{ $g = $x }}{{ end -}}
{{- end -}}
{{- $g | ceil | int -}}
{{- end -}}
{{- end -}}

{{/* The Serve config (serveConfigV2): the specserve values are AppConfig,
     passed as the args of the one builder. */}}
{{- define "specserve.serveConfig" -}}
{{- $http := .Values.specserve.http | default dict -}}
http_options:
  host: {{ $http.host | default "0.0.0.0" | quote }}
  port: {{ $http.port | default 8000 | int }}
applications:
  - name: specserve
    route_prefix: /
    import_path: deployments.app:app_from_args
    args:
      {{- toYaml .Values.specserve | nindent 6 }}
{{- end -}}

{{/* One Ray container: (dict "ctx" $ "name" "ray-worker" "group" $values "gpus" N "head" bool). */}}
{{- define "specserve.container" -}}
{{- $ := .ctx -}}
{{- $g := .group -}}
- name: {{ .name }}
  image: {{ $g.image | default (include "specserve.image" $) }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  {{- $res := deepCopy ($g.resources | default dict) }}
  {{- if gt (int .gpus) 0 }}
  {{- $limits := $res.limits | default dict }}
  {{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
  {{- $_ := set $res "limits" $limits }}
  {{- end }}
  {{- with $res }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    {{- if .head }}
    - {name: gcs-server, containerPort: 6379}
    - {name: dashboard, containerPort: 8265}
    - {name: client, containerPort: 10001}
    {{- end }}
    - name: serve
      containerPort: {{ ($.Values.specserve.http | default dict).port | default 8000 | int }}
    - {name: metrics, containerPort: 8080}
  {{- with $g.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: shm, mountPath: /dev/shm}
    {{- with $g.volumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* Pod-level settings shared by the groups: (dict "ctx" $ "group" $values). */}}
{{- define "specserve.podSpec" -}}
{{- $ := .ctx -}}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: shm
    emptyDir: {medium: Memory}
  {{- with .group.volumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* rayStartParams as a YAML mapping; values must be strings. */}}
{{- define "specserve.rayStartParams" -}}
{{- $out := dict -}}
{{- range $k, $v := . }}{{ $_ := set $out $k (toString $v) }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}
