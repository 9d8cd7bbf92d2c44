"""Settings → Backend: the local engine (default) or an OpenAI-compatible server (URL, optional API key, and its
model, picked from the server's /v1/models)."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QWidget,
)

from app.backends import http


@dataclass(frozen=True)
class BackendChoice:
    kind: str  # "local" or "remote"
    url: str = ""
    api_key: str | None = None
    model: str | None = None


class BackendDialog(QDialog):
    def __init__(self, choice: BackendChoice, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Backend")
        form = QFormLayout(self)
        self.local = QRadioButton("Local engine (this computer)", self)
        self.remote = QRadioButton("OpenAI-compatible server (kvscope serve, vLLM, llama.cpp server)", self)
        (self.remote if choice.kind == "remote" else self.local).setChecked(True)
        self.url = QLineEdit(choice.url, self, placeholderText="http://127.0.0.1:8000")
        self.api_key = QLineEdit(choice.api_key or "", self, placeholderText="optional",
                                 echoMode=QLineEdit.EchoMode.Password)
        self.model = QComboBox(self, editable=True)
        if choice.model:
            self.model.addItem(choice.model)
        self.refresh = QPushButton("Get models from the server", self)
        self.message = QLabel("", self, wordWrap=True)
        for row in (self.local, self.remote):
            form.addRow(row)
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.api_key)
        form.addRow("Model", self.model)
        form.addRow(self.refresh)
        form.addRow(self.message)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.refresh.clicked.connect(self.fetch_models)
        self.remote.toggled.connect(self._enable)
        self._enable(self.remote.isChecked())

    def _enable(self, remote: bool) -> None:
        for widget in (self.url, self.api_key, self.model, self.refresh):
            widget.setEnabled(remote)

    def fetch_models(self) -> None:
        """Fill the model list from the server's /v1/models (a few seconds at most when it is unreachable)."""
        with http.make_client() as client:
            try:
                models = http.list_models(client, self.url.text(), self.api_key.text() or None)
            except http.RemoteError as e:
                self.message.setText(str(e))
                return
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems([m.id for m in models])
        if current in [m.id for m in models]:
            self.model.setCurrentText(current)
        self.message.setText(f"{len(models)} model(s) served at {http.base_url(self.url.text())}")

    def choice(self) -> BackendChoice:
        if not self.remote.isChecked():
            return BackendChoice("local", self.url.text().strip(), self.api_key.text() or None,
                                 self.model.currentText() or None)
        return BackendChoice("remote", self.url.text().strip(), self.api_key.text() or None,
                             self.model.currentText() or None)
