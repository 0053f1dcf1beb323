{{/* Chart name, cut to the 63 characters Kubernetes names allow. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name; also the RayCluster's name, which KubeRay puts in ray.io/cluster. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Pods are selected by the labels KubeRay sets on them. */}}
{{- define "pdserve.headSelector" -}}
ray.io/cluster: {{ include "pdserve.fullname" . }}
ray.io/node-type: head
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdserve.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.clusterSecret" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* The router command: start Ray from KubeRay's generated command minus --block, then
     run `pdserve serve` in the foreground so the container lives and dies with it. */}}
{{- define "pdserve.serveCommand" -}}
{{- $ptp := int (.Values.prefill.tensorParallelSize | default 1) -}}
{{- $dtp := int (.Values.decode.tensorParallelSize | default 1) -}}
{{- if mod (int .Values.prefill.gpusPerWorker) $ptp -}}
{{- fail (printf "prefill.tensorParallelSize: %d does not divide prefill.gpusPerWorker %d (a worker's ranks share one pod)" $ptp (int .Values.prefill.gpusPerWorker)) -}}
{{- end -}}
{{- if mod (int .Values.decode.gpusPerWorker) $dtp -}}
{{- fail (printf "decode.tensorParallelSize: %d does not divide decode.gpusPerWorker %d (a worker's ranks share one pod)" $dtp (int .Values.decode.gpusPerWorker)) -}}
{{- end -}}
{{- $prefill := div (mul .Values.prefill.replicas .Values.prefill.gpusPerWorker) $ptp -}}
{{- $decode := div (mul .Values.decode.replicas .Values.decode.gpusPerWorker) $dtp -}}
ulimit -n 65536; ${KUBERAY_GEN_RAY_START_CMD//--block/} && exec pdserve serve --address auto --host 0.0.0.0 --worker-host node --node-label pdserve-role --port {{ .Values.router.httpPort }} --grpc-port {{ .Values.router.grpcPort }} --prefill {{ $prefill }} --decode {{ $decode }} --prefill-tp {{ $ptp }} --decode-tp {{ $dtp }}
{{- with .Values.model }} --model {{ . | quote }}{{ end }}
{{- if .Values.apiKey.enabled }} --api-key "$PDSERVE_API_KEY"{{ end }} --cluster-secret-file /etc/pdserve/cluster/secret
{{- range .Values.extraServeArgs }} {{ . | quote }}{{ end }}
{{- end -}}

{{/* One GPU worker group; call with (dict "root" $ "role" "prefill" "pool" .Values.prefill). */}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root -}}
- groupName: {{ .role }}
  replicas: {{ .pool.replicas }}
  minReplicas: {{ .pool.replicas }}
  maxReplicas: {{ .pool.replicas }}
  rayStartParams:
    num-gpus: {{ .pool.gpusPerWorker | quote }}
    labels: {{ printf "pdserve-role=%s" .role | quote }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .role }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["/bin/bash", "-lc", "--"]
          args: ["ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD"]
          resources:
            requests:
              {{- with .pool.resources.requests }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              {{ $root.Values.gpuResourceName }}: {{ .pool.gpusPerWorker }}
            limits:
              {{- with .pool.resources.limits }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              {{ $root.Values.gpuResourceName }}: {{ .pool.gpusPerWorker }}
          volumeMounts:
            - name: shm
              mountPath: /dev/shm
            {{- with $root.Values.volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shmSize }}
        {{- with $root.Values.volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
