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
     (specserve:<appVersion>-gpu when any pool asks for GPUs, -cpu otherwise;
     the head, which holds no GPU, always -cpu): (dict "ctx" $ "head" bool). */}}
{{- define "specserve.image" -}}
{{- $ := .ctx -}}
{{- $flavor := ternary "gpu" "cpu" (and (not .head) (eq (include "specserve.anyGpus" $) "true")) -}}
{{- printf "%s:%s" $.Values.image.repository ($.Values.image.tag | default (printf "%s-%s" $.Chart.AppVersion $flavor)) -}}
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
{{- mulf (div ($t.tensor_parallel_size | default 1 | int) ($t.hosts | default 1 | int)) ($res.gpus_per_worker | default 0) | ceil | int -}}
{{- end -}}
{{- end -}}

{{/* The worker group settings of one draft pool, as JSON: workerGroups.draft
     with the keys of workerGroups.draftPools.<name> replacing its own:
     (dict "ctx" $ "name" $poolName). */}}
{{- define "specserve.poolGroup" -}}
{{- $g := deepCopy .ctx.Values.workerGroups.draft -}}
{{- range $k, $v := get (.ctx.Values.workerGroups.draftPools | default dict) .name | default dict -}}
{{- $_ := set $g $k $v -}}
{{- end -}}
{{- toJson $g -}}
{{- end -}}

{{/* nvidia.com/gpu per pod of a draft pool: the group's gpus, or the pool's
     gpus_per_worker rounded up: (dict "pool" $draft "group" $settings). */}}
{{- define "specserve.poolGpus" -}}
{{- if not (kindIs "invalid" .group.gpus) -}}
{{- .group.gpus | int -}}
{{- else -}}
{{- (.pool.resources | default dict).gpus_per_worker | default 0 | float64 | ceil | int -}}
{{- end -}}
{{- end -}}

{{/* Whether any pod asks for GPUs ("true" or ""). */}}
{{- define "specserve.anyGpus" -}}
{{- $any := gt (include "specserve.targetGpus" . | int) 0 -}}
{{- range .Values.specserve.drafts -}}
{{- $g := include "specserve.poolGroup" (dict "ctx" $ "name" .name) | fromJson -}}
{{- if gt (include "specserve.poolGpus" (dict "pool" . "group" $g) | int) 0 }}{{ $any = true }}{{ end -}}
{{- end -}}
{{- if $any }}true{{ end -}}
{{- end -}}

{{/* The Serve config (serveConfigV2), as deployments.app.serve_app writes
     it: the specserve values (AppConfig) split in two (specserve.config.live).
     The code part is the builder's `args`, which Ray hashes into the code
     version of every deployment: models, TP, engine and resource settings,
     with K held at the engine's ceiling (max_speculative_tokens, or K).
     The live part (K, k_control, quotas, replica bounds) is the router's and
     the target's `user_config`, which Serve hands to the running replicas'
     `reconfigure`; the bounds and the target's queue limit are also deployment
     options, which Serve applies without new replicas. So a change of a live
     setting restarts no engine. serve-defaults.json (`make helm-schema`)
     holds the defaults the split needs. */}}
{{- define "specserve.serveConfig" -}}
{{- $app := include "specserve.appConfig" . | fromYaml -}}
{{- $d := .Files.Get "serve-defaults.json" | fromJson -}}
{{- $http := $app.http | default dict -}}
{{- $spec := deepCopy ($app.speculation | default dict) -}}
{{- $k := $d.num_speculative_tokens -}}
{{- if not (kindIs "invalid" $spec.num_speculative_tokens) }}{{ $k = $spec.num_speculative_tokens }}{{ end -}}
{{- $ceiling := $k -}}
{{- if not (kindIs "invalid" $spec.max_speculative_tokens) }}{{ $ceiling = $spec.max_speculative_tokens }}{{ end -}}
{{- $t := deepCopy ($app.target | default dict) -}}
{{- $router := deepCopy ($app.router | default dict) -}}
{{- $poolBounds := dict -}}
{{- $codeDrafts := list -}}
{{- range $app.drafts | default list -}}
{{- $_ := set $poolBounds .name (.replicas | default dict) -}}
{{- $c := deepCopy . -}}{{- $_ := unset $c "replicas" -}}
{{- $codeDrafts = append $codeDrafts $c -}}
{{- end -}}
{{- $quotas := $app.quotas | default dict -}}
{{- $live := dict "speculation" (dict "num_speculative_tokens" $k "k_control" ($spec.k_control | default dict))
    "quotas" $quotas "replicas" (dict "target" ($t.replicas | default dict) "router" ($router.replicas | default dict) "drafts" $poolBounds) -}}
{{- /* The code part: the live settings out, K at the ceiling. */ -}}
{{- $code := deepCopy $app -}}
{{- $_ := set $spec "num_speculative_tokens" $ceiling -}}
{{- $_ := set $spec "max_speculative_tokens" $ceiling -}}
{{- $_ := unset $spec "k_control" -}}
{{- $_ := set $code "speculation" $spec -}}
{{- $_ := unset $code "quotas" -}}
{{- $_ := unset $t "replicas" -}}
{{- $_ := set $code "target" $t -}}
{{- $_ := unset $router "replicas" -}}
{{- $_ := set $code "router" $router -}}
{{- if hasKey $code "drafts" }}{{ $_ := set $code "drafts" $codeDrafts }}{{ end -}}
{{- /* The deployments' options (deployments.app.serve_app). */ -}}
{{- $queue := $d.max_queued_requests -}}
{{- if hasKey $quotas "max_queued_requests" }}{{ $queue = $quotas.max_queued_requests }}{{ end -}}
{{- if kindIs "invalid" $queue }}{{ $queue = -1 }}{{ end -}}
{{- $target := dict "name" "target" "user_config" $live "max_queued_requests" (int $queue) -}}
{{- range $key, $v := include "specserve.scaling" (dict "replicas" ($app.target | default dict).replicas "pool" "target" "defaults" $d) | fromJson }}{{ $_ := set $target $key $v }}{{ end -}}
{{- $routerOptions := dict "name" "router" "user_config" $live -}}
{{- $ongoing := $router.target_ongoing_requests | default $d.router_target_ongoing_requests -}}
{{- range $key, $v := include "specserve.scaling" (dict "replicas" ($app.router | default dict).replicas "pool" "router" "defaults" $d "ongoing" $ongoing) | fromJson }}{{ $_ := set $routerOptions $key $v }}{{ end -}}
{{- $deployments := list $routerOptions $target -}}
{{- range $app.drafts | default list -}}
{{- $one := dict "name" (printf "draft-%s" .name) -}}
{{- range $key, $v := include "specserve.scaling" (dict "replicas" .replicas "pool" "draft" "defaults" $d) | fromJson }}{{ $_ := set $one $key $v }}{{ end -}}
{{- $deployments = append $deployments $one -}}
{{- end -}}
{{- toYaml (dict
    "http_options" (dict "host" ($http.host | default "0.0.0.0") "port" ($http.port | default 8000 | int))
    "applications" (list (dict "name" $d.app.name "route_prefix" "/" "import_path" $d.app.import_path
                               "args" $code "deployments" $deployments))) -}}
{{- end -}}

{{/* A mapping with `defaults` for the keys it lacks or holds null, as JSON:
     (list $given $defaults). 0 and false are kept (sprig's merge would
     replace them). */}}
{{- define "specserve.withDefaults" -}}
{{- $out := deepCopy (index . 0 | default dict) -}}
{{- range $key, $v := index . 1 -}}
{{- if or (not (hasKey $out $key)) (kindIs "invalid" (get $out $key)) }}{{ $_ := set $out $key $v }}{{ end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* A pool's Serve replica options as JSON, as deployments.app._scaling:
     fixed replicas, or autoscaling with specserve's policy of the pool:
     (dict "replicas" $boundsOrNil "pool" "target" "defaults" $serveDefaults);
     the router ("pool" "router" "ongoing" N) autoscales with Serve's own policy. */}}
{{- define "specserve.scaling" -}}
{{- $d := .defaults -}}
{{- $r := include "specserve.withDefaults" (list .replicas $d.replicas) | fromJson -}}
{{- if eq (int $r.min_replicas) (int $r.max_replicas) -}}
{{- toJson (dict "num_replicas" (int $r.max_replicas) "autoscaling_config" nil) -}}
{{- else if eq .pool "router" -}}
{{- /* Serve's own request-based policy (deployments.app._router_scaling). */ -}}
{{- toJson (dict "num_replicas" nil "autoscaling_config" (dict
    "min_replicas" (int $r.min_replicas) "max_replicas" (int $r.max_replicas)
    "initial_replicas" $r.initial_replicas
    "upscale_delay_s" $r.upscale_delay_s "downscale_delay_s" $r.downscale_delay_s
    "target_ongoing_requests" .ongoing)) -}}
{{- else -}}
{{- toJson (dict "num_replicas" nil "autoscaling_config" (dict
    "min_replicas" (int $r.min_replicas) "max_replicas" (int $r.max_replicas)
    "initial_replicas" $r.initial_replicas
    "upscale_delay_s" $r.upscale_delay_s "downscale_delay_s" $r.downscale_delay_s
    "look_back_period_s" $d.look_back_period_s
    "policy" (dict "policy_function" (get $d.policies .pool)))) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the API key ("" without one). */}}
{{- define "specserve.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "specserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "specserve.apiKeyEnv" -}}SPECSERVE_API_KEY{{- end -}}

{{/* The Ray resource router replicas ask for (specserve.router.ray_resource):
     only the router group's pods advertise it, or the head without that group;
     only those pods get the API and metrics keys. */}}
{{- define "specserve.routerResource" -}}specserve_router{{- end -}}

{{/* What a router-hosting pod advertises: routers per pod (the head: any number). */}}
{{- define "specserve.routerResources" -}}
{{- toJson (dict (include "specserve.routerResource" .ctx) (.perPod | default 1000 | int)) -}}
{{- end -}}

{{/* The Secret holding the /metrics scrape key ("" without one). */}}
{{- define "specserve.metricsKeySecret" -}}
{{- if .Values.metricsKey.existingSecret -}}
{{- .Values.metricsKey.existingSecret -}}
{{- else if .Values.metricsKey.value -}}
{{- printf "%s-metrics-key" (include "specserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "specserve.metricsKeyEnv" -}}SPECSERVE_METRICS_KEY{{- end -}}

{{/* values.specserve as the app's args: with an API key Secret, the router
     reads the key from SPECSERVE_API_KEY (http.api_key_env); a plain-text
     http.api_key is refused, as it would be readable in the RayService. */}}
{{- define "specserve.appConfig" -}}
{{- $app := deepCopy .Values.specserve -}}
{{- $router := $app.router | default dict -}}
{{- if $router.ray_resource -}}
{{- fail "specserve.router.ray_resource is the chart's to set (it pins the router to the router group's pods or the head); remove it" -}}
{{- end -}}
{{- $_ := set $router "ray_resource" (include "specserve.routerResource" .) -}}
{{- $_ := set $app "router" $router -}}
{{- $http := $app.http | default dict -}}
{{- if $http.api_key -}}
{{- fail "specserve.http.api_key would be written in plain text into the RayService's serveConfigV2; put the key in a Secret: set apiKey.existingSecret (or apiKey.value) instead" -}}
{{- end -}}
{{- if include "specserve.apiKeySecret" . -}}
{{- $_ := set $http "api_key_env" (include "specserve.apiKeyEnv" .) -}}
{{- $_ := unset $http "api_key" -}}
{{- $_ := set $app "http" $http -}}
{{- end -}}
{{- if include "specserve.metricsKeySecret" . -}}
{{- $_ := set $http "metrics_key_env" (include "specserve.metricsKeyEnv" .) -}}
{{- $_ := set $app "http" $http -}}
{{- end -}}
{{- if include "specserve.draftTlsSecret" . -}}
{{- if $app.grpc_tls -}}
{{- fail "specserve.grpc_tls and draftTls.enabled both configure the draft stream's TLS; set draftTls.enabled=false to use your own files, or remove specserve.grpc_tls" -}}
{{- end -}}
{{- $dir := include "specserve.draftTlsDir" . -}}
{{- $_ := set $app "grpc_tls" (dict "ca_file" (printf "%s/ca.crt" $dir) "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "server_name" .Values.draftTls.serverName) -}}
{{- end -}}
{{- toYaml $app -}}
{{- end -}}

{{/* The Secret of the draft stream's certificates ("" without TLS or drafts). */}}
{{- define "specserve.draftTlsSecret" -}}
{{- if and .Values.draftTls.enabled .Values.specserve.drafts -}}
{{- .Values.draftTls.existingSecret | default (printf "%s-draft-tls" (include "specserve.fullname" .)) -}}
{{- end -}}
{{- end -}}

{{- define "specserve.draftTlsDir" -}}/etc/specserve/draft-tls{{- end -}}

{{/* The Serve HTTP port (specserve.http.port). */}}
{{- define "specserve.servePort" -}}
{{- (.Values.specserve.http | default dict).port | default 8000 | int -}}
{{- end -}}

{{/* The draft sink's port on target pods (specserve.target.sink_port). */}}
{{- define "specserve.sinkPort" -}}
{{- (.Values.specserve.target | default dict).sink_port | default 0 | int -}}
{{- end -}}

{{/* Ray's fixed ports as rayStartParams (rayPorts). */}}
{{- define "specserve.rayPortParams" -}}
{{- $p := .Values.rayPorts -}}
{{- toJson (dict "object-manager-port" $p.objectManager "node-manager-port" $p.nodeManager
    "runtime-env-agent-port" $p.runtimeEnvAgent "dashboard-agent-grpc-port" $p.dashboardAgentGrpc
    "dashboard-agent-listen-port" $p.dashboardAgentListen "metrics-export-port" $p.metricsExport
    "min-worker-port" $p.minWorker "max-worker-port" $p.maxWorker) -}}
{{- end -}}

{{/* The head's own Ray ports (KubeRay's defaults; the head container names them). */}}
{{- define "specserve.headPorts" -}}
{{- toJson (dict "gcs-server" 6379 "dashboard" 8265 "client" 10001) -}}
{{- end -}}

{{/* A Kubernetes CPU quantity in cores ("2", "500m", 1.5). */}}
{{- define "specserve.cores" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}{{- divf (trimSuffix "m" $q | float64) 1000.0 -}}
{{- else -}}{{- $q | float64 -}}{{- end -}}
{{- end -}}

{{/* A Kubernetes memory quantity in GiB ("300Gi", "64G", "512Mi", bytes). */}}
{{- define "specserve.gib" -}}
{{- $q := toString . -}}
{{- $units := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "K" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 -}}
{{- $bytes := 0.0 -}}
{{- $done := false -}}
{{- range $u := list "Ki" "Mi" "Gi" "Ti" "K" "M" "G" "T" -}}
{{- if and (not $done) (hasSuffix $u $q) -}}
{{- $bytes = mulf (trimSuffix $u $q | float64) (get $units $u) -}}
{{- $done = true -}}
{{- end -}}
{{- end -}}
{{- if not $done }}{{ $bytes = $q | float64 }}{{ end -}}
{{- divf $bytes 1073741824.0 -}}
{{- end -}}

{{/* Fail when a group's gpus override is fewer than one replica needs:
     (dict "have" $gpusOrNil "need" N "name" "target" "why" "..."). */}}
{{- define "specserve.checkGpus" -}}
{{- if and (not (kindIs "invalid" .have)) (lt (float64 .have) (.need | float64 | ceil)) -}}
{{- fail (printf "workerGroups.%s.gpus %v is less than the %v GPUs one replica needs on a pod (%s): its bundles would never fit and the replica would never start; raise gpus or remove it (null: what the replica needs)" .name .have (.need | float64 | ceil) .why) -}}
{{- end -}}
{{- end -}}

{{/* Fail when a pod cannot hold what its replicas ask Ray for:
     (dict "group" $values "name" "target" "cpus" N "gib" N "why" "..." ["path" "draftPools.x"]);
     path: where the group's resources are set (default: name). */}}
{{- define "specserve.checkFit" -}}
{{- $res := .group.resources | default dict -}}
{{- $have := $res.limits | default ($res.requests | default dict) -}}
{{- if and (hasKey $have "cpu") (gt (.cpus | float64) (include "specserve.cores" (get $have "cpu") | float64)) -}}
{{- fail (printf "workerGroups.%s.resources: cpu %v is less than the %v CPUs one %s replica asks Ray for (%s); raise the pod's cpu or lower cpus_per_worker" (.path | default .name) (get $have "cpu") .cpus .name .why) -}}
{{- end -}}
{{- if and (gt (.gib | float64) 0.0) (hasKey $have "memory") (gt (.gib | float64) (include "specserve.gib" (get $have "memory") | float64)) -}}
{{- fail (printf "workerGroups.%s.resources: memory %v is less than the %vGi one %s replica asks Ray for (%s); raise the pod's memory or lower memory_gib" (.path | default .name) (get $have "memory") .gib .name .why) -}}
{{- end -}}
{{- end -}}

{{/* One Ray container: (dict "ctx" $ "name" "ray-worker" "group" $values "gpus" N "head" bool
     "drafting" bool "router" bool "cpu" bool): cpu: the CPU image; drafting containers (targets and drafts) mount the draft
     stream's certificates; router containers (where router replicas run) get the keys. */}}
{{- define "specserve.container" -}}
{{- $ := .ctx -}}
{{- $g := .group -}}
- name: {{ .name }}
  image: {{ $g.image | default (include "specserve.image" (dict "ctx" $ "head" (or .head .cpu))) }}
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
    {{- range $name, $port := include "specserve.headPorts" $ | fromJson }}
    - {name: {{ $name }}, containerPort: {{ $port | int }}}
    {{- end }}
    {{- end }}
    - name: serve
      containerPort: {{ include "specserve.servePort" $ }}
    - {name: metrics, containerPort: {{ $.Values.rayPorts.metricsExport | int }}}
  {{- $secret := and .router (include "specserve.apiKeySecret" $) }}
  env:
    # Ray would start its workers (the Serve replicas and their vLLM engines) at
    # nice 15, under every other process in the pod (specserve.placement.RAY_NODE_ENV).
    - {name: RAY_worker_niceness, value: "0"}
    {{- with $g.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if $secret }}
    # The router (only on pods that advertise specserve.routerResource) reads
    # the API key from here (http.api_key_env).
    - name: {{ include "specserve.apiKeyEnv" $ }}
      valueFrom:
        secretKeyRef: {name: {{ $secret }}, key: {{ $.Values.apiKey.secretKey }}}
    {{- end }}
    {{- with and .router (include "specserve.metricsKeySecret" $) }}
    # ... and the /metrics scrape key (http.metrics_key_env).
    - name: {{ include "specserve.metricsKeyEnv" $ }}
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $.Values.metricsKey.secretKey }}}
    {{- end }}
  {{- with $g.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.startupProbe }}
  startupProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: shm, mountPath: /dev/shm}
    {{- if and .drafting (include "specserve.draftTlsSecret" $) }}
    - {name: draft-tls, mountPath: {{ include "specserve.draftTlsDir" $ }}, readOnly: true}
    {{- end }}
    {{- with $g.volumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* Pod-level settings shared by the groups: (dict "ctx" $ "group" $values "drafting" bool). */}}
{{- define "specserve.podSpec" -}}
{{- $ := .ctx -}}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" .group.terminationGracePeriodSeconds) }}
terminationGracePeriodSeconds: {{ .group.terminationGracePeriodSeconds | int }}
{{- end }}
{{- with .group.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .group.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .group.topologySpreadConstraints }}
topologySpreadConstraints:
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
    emptyDir:
      medium: Memory
      {{- with .group.shmSizeLimit }}
      sizeLimit: {{ . }}
      {{- end }}
  {{- if and .drafting (include "specserve.draftTlsSecret" $) }}
  - name: draft-tls
    secret: {secretName: {{ include "specserve.draftTlsSecret" $ }}, defaultMode: 0440}
  {{- end }}
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


{{/* A group's rayStartParams with the accelerator types its pools ask for
     advertised as Ray resources (accelerator_type:<T>), so KubeRay's
     autoscaler knows which group to grow for a bundle that asks for one:
     (dict "ctx" $ "params" $groupParams "types" (list "H100") ["resources" $moreResources]).
     Ray's fixed ports (rayPorts) are added; explicit params win. */}}
{{- define "specserve.groupStartParams" -}}
{{- $p := merge (deepCopy (.params | default dict)) (include "specserve.rayPortParams" .ctx | fromJson) -}}
{{- if and (or .types .resources) (not (hasKey $p "resources")) -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- range .types }}{{ $_ := set $res (printf "accelerator_type:%s" .) 1 }}{{ end -}}
{{- $_ := set $p "resources" (printf "%q" (toJson $res)) -}}
{{- end -}}
{{- include "specserve.rayStartParams" $p -}}
{{- end -}}

{{/* A worker group's idleTimeoutSeconds (KubeRay reads it with autoscaler v2
     only): (dict "ctx" $ "group" $settings "name" "target"). */}}
{{- define "specserve.idleTimeout" -}}
{{- if not (kindIs "invalid" .group.idleTimeoutSeconds) -}}
{{- if ne (toString .ctx.Values.autoscaler.version) "v2" -}}
{{- fail (printf "the %s group's idleTimeoutSeconds needs KubeRay's autoscaler v2; set autoscaler.version=v2 or remove it (autoscaler.idleTimeoutSeconds applies to every group)" .name) -}}
{{- end -}}
idleTimeoutSeconds: {{ .group.idleTimeoutSeconds | int }}
{{- end -}}
{{- end -}}
